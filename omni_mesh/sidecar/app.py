"""The sidecar's aiohttp application and its lifecycle.

Start-up, each step a ``cleanup_ctx`` (torn down in reverse): hop HTTP client → engine
process (HELLO/READY) → control-plane client and pool watcher → registration and heartbeats
(only after READY). On SIGTERM the pod drains: it leaves the pool first, finishes what is in
flight, then stops the engine. When the engine dies the pod leaves the pool and exits non-zero
so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry

from omni_mesh.configs.deploy import DeployConfig
from omni_mesh.configs.fingerprint import pipeline_fingerprint
from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.configs.stage_settings import StageSettings
from omni_mesh.control_plane.client import (
    KV_ROLE_LABEL,
    ControlPlaneClient,
    ControlPlaneError,
    InstanceLease,
    PoolWatcher,
    RegisterRequest,
    SuspectReporter,
)
from omni_mesh.data_plane.connectors import EdgeConnectors
from omni_mesh.data_plane.messages import StageInput
from omni_mesh.data_plane.shm import ShmReader, sweep_orphans
from omni_mesh.data_plane.signing import hop_token
from omni_mesh.observability.children import labelled
from omni_mesh.observability.metrics import SidecarMetrics
from omni_mesh.sidecar.admission.early_shed import SHEDDABLE_ROUTES, EarlyShed
from omni_mesh.sidecar.admission.load_report import load_report
from omni_mesh.sidecar.api import hop_route as routes_hop
from omni_mesh.sidecar.api import input_route as routes_input
from omni_mesh.sidecar.api import routes as routes_api
from omni_mesh.sidecar.api import run as routes_run
from omni_mesh.sidecar.api.hop_server import HopSite
from omni_mesh.sidecar.api.realtime.cp_store import ControlPlaneSessionStore
from omni_mesh.sidecar.api.realtime.route import REALTIME
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.engine_link.client import EngineClient
from omni_mesh.sidecar.gc_pacer import GcPacer, PacerSettings
from omni_mesh.sidecar.hop.budget import HopStats
from omni_mesh.sidecar.hop.client import HOP_TOKEN_HEADER, HopClient
from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.liveness import HopLiveness, LivenessConfig
from omni_mesh.sidecar.hop.prefill_tokens import reported_prefill_tokens
from omni_mesh.sidecar.hop.router import Replica, Router
from omni_mesh.sidecar.hop.waker import StageWaker
from omni_mesh.sidecar.middleware import api_metrics_middleware, error_middleware
from omni_mesh.sidecar.pod import Pod, resolve_secret
from omni_mesh.sidecar.runner import InputFeeds, StageRunner

logger = logging.getLogger(__name__)

#: Socket read size of the HTTP server and client: large bodies arrive in fewer pieces.
READ_BUFSIZE = 1 << 20
#: Listen backlog: a burst of senders must reach the admission queue, not time out connecting
#: (a full backlog drops SYNs, which looks like a silent host to the hop client).
LISTEN_BACKLOG = 4096
#: Idle keep-alive connections kept per replica: under overload hundreds of hops wait in a
#: receiver's queue at once, and a new connection per hop would flood its backlog.
HOP_IDLE_PER_HOST = 1024


def _labels(pod: Pod, api_only: bool) -> dict[str, str]:
    """The pod's labels in the control plane: how it serves, and a split stage's pool."""
    labels = {"role": "api-only" if api_only else "api" if pod.serves_api else "headless"}
    if not api_only and pod.stage_config.prefill is not None:
        role = pod.settings.role
        labels[KV_ROLE_LABEL] = "decode" if role == "both" else role
    return labels


class WatchedPools:
    """Adapts the control plane's watch cache to the router's :class:`PoolView`."""

    def __init__(self, watcher: PoolWatcher | None) -> None:
        self.watcher = watcher
        # The replicas of each stage, built once per snapshot the watcher holds (a hop reads
        # its pool more than once: the split-stage check, then the pick).
        self._built: dict[int, tuple[Replica, ...]] = {}
        self._built_from: object = None

    def replicas(self, stage_id: int) -> Iterable[Replica]:
        if self.watcher is None:
            return ()
        snapshot = self.watcher.snapshot
        if snapshot is not self._built_from:
            self._built, self._built_from = {}, snapshot
        built = self._built.get(stage_id)
        if built is None:
            built = self._built[stage_id] = tuple(
                Replica(
                    instance_id=i.instance_id,
                    stage_id=i.stage_id,
                    address=i.address,
                    host_id=i.host_id or "",
                    capacity=i.capacity,
                    reported_in_flight=i.load.in_flight if i.load is not None else 0,
                    kv_role=i.labels.get(KV_ROLE_LABEL, ""),
                    reported_prefill_tokens=reported_prefill_tokens(i.load),
                )
                for i in self.watcher.healthy(stage_id)
            )
        return built

    async def wait_changed(self, timeout_s: float) -> None:
        """Until the pools change (the watch cache's event) or ``timeout_s`` passes."""
        if self.watcher is None:
            await asyncio.sleep(min(timeout_s, 0.25))  # no control plane yet
            return
        await self.watcher.wait_changed(timeout_s)


async def build_pod(
    settings: StageSettings,
    pipeline: PipelineSpec,
    deploy: DeployConfig,
    connectors: EdgeConnectors | None = None,
) -> Pod:
    """Everything the pod holds that needs no child process (call inside the event loop)."""
    metrics = SidecarMetrics(CollectorRegistry())
    pools = WatchedPools(None)
    router = Router(pools, host_id=settings.host_id)
    reader = ShmReader()
    http = HopHttpClient(
        connect_timeout_s=settings.hop_connect_timeout_s,
        keepalive_s=settings.hop_keepalive_s,
        max_idle_per_host=HOP_IDLE_PER_HOST,
    )
    secret = resolve_secret(settings)
    hop = HopClient(
        http,
        router,
        connectors or EdgeConnectors(deploy, pipeline),
        reader,
        retries=deploy.hop_retries,
        auth_header={HOP_TOKEN_HEADER: hop_token(secret)},
        on_hop=lambda si, stats: _record_hop(metrics, pipeline.name, si, stats),
        pool_changes=pools,
    )
    return Pod(
        settings=settings,
        pipeline=pipeline,
        deploy=deploy,
        metrics=metrics,
        secret=secret,
        router=router,
        hop=hop,
        http=http,
        reader=reader,
    )


async def _prune_mappings(pod: Pod, every_s: float = 5.0) -> None:
    """Drop cached mappings of segments their owners unlinked: a mapping keeps the memory of
    an unlinked segment alive, invisible to ``ls /dev/shm``."""
    while True:
        await asyncio.sleep(every_s)
        pod.reader.prune()
        if pod.engine is not None:
            pod.engine.reader.prune()


def _record_hop(metrics: SidecarMetrics, pipeline: str, si: StageInput, stats: HopStats) -> None:
    labels = (pipeline, str(si.from_stage), str(si.stage_id))
    labelled(metrics.handoff_bytes, *labels).inc(stats.bytes_sent)
    labelled(metrics.handoff_duration, *labels).observe(stats.seconds)
    if stats.retries:
        labelled(metrics.hop_retries, *labels).inc(stats.retries)
    for outcome in stats.kv_handoffs:
        labelled(metrics.kv.handoffs, *labels, outcome).inc()
    for outcome in stats.affinity:
        labelled(metrics.affinity_picks, *labels, outcome).inc()


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    pod = app[POD]
    janitor = asyncio.create_task(_prune_mappings(pod), name="prune-shm-mappings")
    liveness = HopLiveness(pod.http, liveness_config(pod.settings))
    liveness.start()  # hops to a replica that went silent fail in about a second: replayed
    yield
    await liveness.close()
    janitor.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await janitor
    await pod.http.close()
    pod.reader.close()


async def sweep_orphaned_shm(*, directory: str | None = None) -> int:
    """Remove segments of dead processes before the engine starts (a directory scan and a
    ``/proc`` read per segment: in a worker thread, off the event loop); how many."""
    removed = await asyncio.to_thread(sweep_orphans, directory=directory)
    if removed:
        logger.info("removed %d orphaned shared-memory segments", removed)
    return removed


def liveness_config(settings: StageSettings) -> LivenessConfig:
    return LivenessConfig(
        probe_after_s=settings.hop_probe_after_s,
        interval_s=settings.hop_probe_interval_s,
        connect_timeout_s=settings.hop_connect_timeout_s,
        answer_timeout_s=settings.hop_probe_timeout_s,
    )


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    pod = app[POD]
    if pod.settings.api_only:
        yield
        return
    await sweep_orphaned_shm()
    config = pod.stage_config
    engine = EngineClient(
        pod.pipeline.name,
        pod.stage_id,
        config,
        devices=config.replica_devices(pod.settings.replica_index) if config.devices else None,
        threads=pod.settings.engine_threads,
        log_level=pod.settings.log_level,
        async_chunk=pod.deploy.async_chunk,
        on_death=lambda reason: pod.stop(1),
    )
    await engine.start(timeout_s=pod.settings.engine_start_timeout_s)
    pod.engine = engine
    pod.hop.reader = engine.reader
    chunks = pod.metrics.output_chunks.labels(pod.pipeline.name, str(pod.stage_id))
    fed = pod.metrics.input_chunks.labels(pod.pipeline.name, str(pod.stage_id))
    pod.runner = StageRunner(
        pod.pipeline,
        pod.stage_id,
        engine,
        pod.hop,
        lambda: pod.instance_id,
        on_chunk=chunks.inc,
        inputs=InputFeeds(pod.input_streams, pod.settings.address, on_fed=fed.inc),
    )
    yield
    await engine.stop(timeout_s=max(5.0, pod.settings.drain_timeout_s))


async def _control_plane_ctx(app: web.Application) -> AsyncIterator[None]:
    pod = app[POD]
    if not pod.settings.control_plane:
        logger.warning("no --control-plane: this pod neither registers nor discovers other stages")
        yield
        return
    token = pod.settings.cp_auth_token.get_secret_value() if pod.settings.cp_auth_token else None
    client = ControlPlaneClient(list(pod.settings.control_plane), auth_token=token)
    suspects = SuspectReporter(client, reporter=pod.settings.address)
    pod.router.on_eject = suspects  # replicas it cannot connect to: the control plane probes
    waker = StageWaker(client, pod.pipeline.name)
    pod.hop.on_empty_pool = waker  # hops waiting for a stage at zero wake it
    watcher = PoolWatcher(client, pod.pipeline.name)
    await watcher.start()
    assert isinstance(pod.router.pools, WatchedPools)
    pod.router.pools.watcher = watcher
    # An API server without an engine registers too (role api: listed by omni-cp status, never
    # in a stage pool); a pod with an engine joins its stage's pool.
    api_only = pod.engine is None
    request = RegisterRequest(
        pipeline=pod.pipeline.name,
        stage_id=pod.stage_id,
        address=pod.settings.address,
        capacity=(api_only and pod.settings.api_max_inflight) or pod.stage_config.max_inflight,
        host_id=pod.settings.host_id,
        labels=_labels(pod, api_only),
        role="api" if api_only else "stage",
        standby=pod.settings.standby and not api_only,
        settings=pipeline_fingerprint(pod.pipeline, pod.deploy),
    )
    # Registered by serve() once the site listens: never advertise a closed port.
    lease = InstanceLease(
        client, request, lambda: load_report(pod), on_refused=lambda exc: _refused(pod, exc)
    )
    app[LEASE] = lease
    hub = app.get(REALTIME)
    if hub is not None:  # realtime sessions live in the control plane's store
        hub.attach_store(ControlPlaneSessionStore(client))
    yield
    if hub is not None:
        await hub.close()
    pod.router.on_eject = None
    await suspects.close()
    pod.hop.on_empty_pool = None
    await waker.close()
    await lease.stop()
    await watcher.stop()
    await client.close()


LEASE: web.AppKey[InstanceLease] = web.AppKey("lease", InstanceLease)


def make_app(pod: Pod) -> web.Application:
    # A client request the admission gate would shed is answered on its headers alone.
    shed_check = EarlyShed(pod).check if pod.serves_api else None
    metrics = api_metrics_middleware(pod.metrics, shed_check, SHEDDABLE_ROUTES)
    app = web.Application(
        middlewares=[metrics, error_middleware],
        client_max_size=pod.settings.max_body_bytes,
    )
    app[POD] = pod
    app.cleanup_ctx.extend([_session_ctx, _engine_ctx, _control_plane_ctx])
    routes_api.add_routes(app, client_api=pod.serves_api)
    routes_run.add_routes(app)
    routes_hop.add_routes(app)
    routes_input.add_routes(app)
    return app


async def serve(pod: Pod) -> int:
    """Run the pod until SIGTERM/SIGINT or engine death; drain; return the exit code.

    Start-up (engine READY, registration) is raced against the stop signal, so a pod that
    cannot reach its control plane or whose engine dies while starting still stops at once."""
    app = make_app(pod)
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, read_bufsize=READ_BUFSIZE
    )
    pacer = GcPacer(
        lambda: _activity(pod),
        pod.metrics.gc,
        PacerSettings(
            busy_pass_s=pod.settings.gc_busy_pass_s, young_pass_s=pod.settings.gc_young_pass_s
        ),
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pod.stop, 0)
    try:
        if not await _until_stopped(pod, runner.setup()):
            return pod.exit_code or 0
        site = HopSite(
            runner,
            pod,
            pod.settings.host,
            pod.settings.port,
            reuse_address=True,
            backlog=LISTEN_BACKLOG,
        )
        await site.start()
        pacer.start()
        register = asyncio.create_task(_register(app, pod), name="register")
        logger.info(
            "listening pipeline=%s stage=%d on %s (%s)",
            pod.pipeline.name,
            pod.stage_id,
            pod.settings.address,
            "api-only"
            if pod.settings.api_only
            else ("headless" if pod.settings.headless else "api"),
        )
        await pod.stop_event.wait()
        register.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await register
        await _drain(app, pod)
    finally:
        await pacer.stop()
        await runner.cleanup()
    return pod.exit_code


def _activity(pod: Pod) -> tuple[int, int]:
    queued = pod.gate.queued if pod.gate is not None else 0
    return pod.in_flight + queued, pod.admitted


async def _until_stopped(pod: Pod, work: Awaitable[None]) -> bool:
    """Await ``work`` unless the pod is told to stop first; True when ``work`` finished."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.create_task(pod.stop_event.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()  # start-up errors (engine failed to load…) propagate
        return not pod.stop_event.is_set()
    logger.info("stop requested during start-up stage=%d", pod.stage_id)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def _register(app: web.Application, pod: Pod) -> None:
    lease = app.get(LEASE)
    if lease is not None:
        try:
            await lease.start()  # retries while the control plane is unreachable
        except ControlPlaneError as exc:  # it answered no (a 4xx): a configuration error
            logger.error("registration refused stage=%d: %s", pod.stage_id, exc)
            pod.stop(2)
            return
        pod.instance_id = lease.instance_id or ""
    pod.ready = True
    logger.info(
        "serving pipeline=%s stage=%d instance=%s on %s",
        pod.pipeline.name,
        pod.stage_id,
        pod.instance_id or "-",
        pod.settings.address,
    )


def _refused(pod: Pod, exc: ControlPlaneError) -> None:
    """Refused after registering (409: back from a lapsed lease, its pipeline-wide settings no
    longer agree with the pipeline's pods): a configuration error, as at registration."""
    logger.error("heartbeat refused stage=%d: %s", pod.stage_id, exc)
    pod.stop(2)


async def _drain(app: web.Application, pod: Pod) -> None:
    """Leave the pool first, then finish in-flight work (bounded), then stop."""
    pod.draining = True
    lease = app.get(LEASE)
    if lease is not None:
        await lease.stop()
    deadline = time.monotonic() + pod.settings.drain_timeout_s
    while pod.in_flight > 0 and time.monotonic() < deadline:
        if pod.engine is not None and pod.engine.dead.is_set():
            break
        await asyncio.sleep(0.05)
    if pod.in_flight:
        logger.warning("drain timed out with %d requests in flight", pod.in_flight)
