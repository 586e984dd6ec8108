"""HTTP handlers of the control plane (DESIGN §6): registration, heartbeats, discovery, operator
actions, suspect reports (probed in ``liveness/suspects.py``), health and metrics. The
long-poll/SSE watch lives in ``watch.py``, the stage scale resource (autoscaling) in ``scale.py``,
realtime sessions in ``sessions.py``.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from redis.exceptions import RedisError

from omni_mesh.configs.pipeline_spec import UnknownPipelineError
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.api import appkeys, watch
from omni_mesh.control_plane.api import scale as routes_scale
from omni_mesh.control_plane.api import sessions as routes_sessions
from omni_mesh.control_plane.api.inputs import (
    bool_param,
    instance_id_param,
    int_param,
    lookup_pipeline,
    lookup_stage,
    read_model,
)
from omni_mesh.control_plane.api.logthrottle import REDIS_UNAVAILABLE
from omni_mesh.control_plane.autoscaling.autoscaler import refresh_gauges
from omni_mesh.control_plane.errors import ConflictError, NotFoundError
from omni_mesh.control_plane.schema import (
    MAX_STAGE_ID,
    DrainRequest,
    HealthStatus,
    HeartbeatAck,
    HeartbeatRequest,
    InstanceState,
    IsolateRequest,
    PipelineList,
    PipelineStatus,
    ProbeOutcome,
    PromoteRequest,
    ReadmitRequest,
    RegisterRequest,
    Registration,
    ScalePool,
    SuspectRequest,
    SuspectResult,
)
from omni_mesh.control_plane.store.instances import SettingsConflict, StateAction
from omni_mesh.observability.metrics import CP_INSTANCE_STATES

logger = logging.getLogger(__name__)


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


def _unknown_instance(instance_id: str) -> NotFoundError:
    return NotFoundError(f"unknown instance {instance_id!r}", field="instance_id")


# ---- health & metrics -----------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    try:
        ok = await request.app[appkeys.STORE].ping()
    except RedisError as exc:
        REDIS_UNAVAILABLE("redis unavailable: GET /healthz: %s", exc)
        ok = False
    return _json(HealthStatus(status="ok" if ok else "unavailable", redis=ok), 200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    try:
        await _refresh_instance_gauge(app)
        await refresh_gauges(app[appkeys.STORE].scale, app[appkeys.METRICS].autoscale)
        await routes_sessions.refresh_gauge(app)
    except RedisError as exc:
        REDIS_UNAVAILABLE("redis unavailable: GET /metrics, instance counts stale: %s", exc)
    body = generate_latest(app[appkeys.METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _refresh_instance_gauge(app: web.Application) -> None:
    store, gauge = app[appkeys.STORE], app[appkeys.METRICS].instances
    statuses: list[PipelineStatus] = []
    for name in await store.pipeline_names():
        try:
            statuses.append(await store.pipeline_status(get_pipeline(name)))
        except UnknownPipelineError:
            logger.warning("redis holds instances of unregistered pipeline=%s", name)
    gauge.clear()
    for status in statuses:
        for stage_id in sorted(get_pipeline(status.pipeline).stage_ids):
            for state in CP_INSTANCE_STATES:
                count = sum(
                    1 for i in status.instances if i.stage_id == stage_id and i.state == state
                )
                gauge.labels(status.pipeline, str(stage_id), state).set(count)


# ---- membership -----------------------------------------------------------------------------


async def register(request: web.Request) -> web.Response:
    body = await read_model(request, RegisterRequest)
    spec = lookup_pipeline(body.pipeline)
    lookup_stage(spec, body.stage_id)
    app = request.app
    settings = app[appkeys.SETTINGS]
    try:
        result = await app[appkeys.STORE].register(body, spec.stage_ids)
    except SettingsConflict as exc:
        raise ConflictError(
            f"pipeline {body.pipeline!r}: pipeline-wide setting {exc.setting} is {exc.ours} "
            f"on this pod but {exc.theirs} on the pods already registered; every pod of a "
            "pipeline must agree",
            field=f"settings.{exc.setting}",
        ) from None
    app[appkeys.METRICS].registrations.labels(body.pipeline, str(body.stage_id)).inc()
    logger.info(
        "registered instance=%s pipeline=%s stage=%s address=%s epoch=%d version=%d",
        result.instance_id,
        body.pipeline,
        body.stage_id,
        body.address,
        result.epoch,
        result.version,
    )
    for old in result.superseded:
        logger.info("instance=%s superseded by instance=%s (same address)", old, result.instance_id)
    registration = Registration(
        instance_id=result.instance_id,
        epoch=result.epoch,
        lease_ttl_ms=settings.lease_ttl_ms,
        heartbeat_interval_ms=settings.heartbeat_interval_ms,
    )
    return _json(registration, status=201)


async def heartbeat(request: web.Request) -> web.Response:
    instance_id = instance_id_param(request)
    body = await read_model(request, HeartbeatRequest, allow_empty=True)
    try:
        result = await request.app[appkeys.STORE].heartbeat(instance_id, body.load)
    except SettingsConflict as exc:
        raise ConflictError(
            f"instance {instance_id}: pipeline-wide setting {exc.setting} is {exc.ours} on this "
            f"pod but {exc.theirs} on the pods registered while its lease had lapsed; every pod "
            "of a pipeline must agree",
            field=f"settings.{exc.setting}",
        ) from None
    if result is None:
        raise _unknown_instance(instance_id)
    if result.revived:
        logger.info(
            "instance=%s heartbeats again: healthy (was %s)", instance_id, result.previous_reason
        )
    ack = HeartbeatAck(
        instance_id=instance_id, epoch=result.epoch, state=result.state, reason=result.reason
    )
    return _json(ack)


async def deregister(request: web.Request) -> web.Response:
    instance_id = instance_id_param(request)
    result = await request.app[appkeys.STORE].deregister(instance_id)
    if result is None:
        raise _unknown_instance(instance_id)
    request.app[appkeys.METRICS].deregistrations.labels(result.pipeline, str(result.stage_id)).inc()
    logger.info(
        "deregistered instance=%s pipeline=%s stage=%s version=%d",
        instance_id,
        result.pipeline,
        result.stage_id,
        result.version,
    )
    return web.Response(status=204)


# ---- operator actions -----------------------------------------------------------------------


async def _change_state(request: web.Request, action: StateAction, reason: str) -> web.Response:
    instance_id = instance_id_param(request)
    store = request.app[appkeys.STORE]
    result = await store.set_state(instance_id, action, reason)
    info = None if result is None else await store.instance(instance_id)
    if result is None or info is None:
        raise _unknown_instance(instance_id)
    if result.changed:
        logger.info(
            "operator %s: instance=%s pipeline=%s stage=%s state=%s reason=%s",
            action.value,
            instance_id,
            info.pipeline,
            info.stage_id,
            result.state.value,
            result.reason or "-",
        )
        if action is StateAction.ISOLATE:
            request.app[appkeys.METRICS].isolations.labels(
                info.pipeline, str(info.stage_id), result.reason
            ).inc()
    return _json(info)


async def isolate(request: web.Request) -> web.Response:
    body = await read_model(request, IsolateRequest, allow_empty=True)
    return await _change_state(request, StateAction.ISOLATE, body.reason)


async def drain(request: web.Request) -> web.Response:
    body = await read_model(request, DrainRequest, allow_empty=True)
    return await _change_state(request, StateAction.DRAIN, body.reason)


async def readmit(request: web.Request) -> web.Response:
    await read_model(request, ReadmitRequest, allow_empty=True)
    return await _change_state(request, StateAction.READMIT, "")


async def promote(request: web.Request) -> web.Response:
    """A standby into its pool at once (what the autoscaler does when the pool is short);
    any other state is left as it is."""
    await read_model(request, PromoteRequest, allow_empty=True)
    return await _change_state(request, StateAction.PROMOTE, "")


async def suspect(request: web.Request) -> web.Response:
    """A sender could not connect to the instance: probe it here, isolate it if it is dead."""
    instance_id = instance_id_param(request)
    body = await read_model(request, SuspectRequest)
    app = request.app
    store = app[appkeys.STORE]
    info = await store.instance(instance_id)
    if info is None:
        raise _unknown_instance(instance_id)
    app[appkeys.METRICS].suspects.labels(info.pipeline, str(info.stage_id)).inc()
    logger.info(
        "suspect instance=%s pipeline=%s stage=%s state=%s reported by %s: %s",
        instance_id,
        info.pipeline,
        info.stage_id,
        info.state.value,
        body.reporter or "-",
        body.reason,
    )
    if info.state is not InstanceState.HEALTHY:  # already out of discovery: nothing to probe
        result = SuspectResult(
            instance_id=instance_id,
            isolated=info.state is InstanceState.ISOLATED,
            probe=ProbeOutcome.SKIPPED,
            detail=f"instance is {info.state.value} ({info.reason or '-'}): not probed",
            state=info.state,
            reason=info.reason,
        )
        return _json(result)
    probe, reused = await app[appkeys.SUSPECTS].check(info)
    after = await store.instance(instance_id)
    if after is None:  # it left (deregistered or superseded) meanwhile
        raise _unknown_instance(instance_id)
    result = SuspectResult(
        instance_id=instance_id,
        isolated=after.state is InstanceState.ISOLATED,
        probe=probe.outcome,
        detail=probe.detail,
        cached=reused,
        state=after.state,
        reason=after.reason,
    )
    return _json(result)


# ---- discovery ------------------------------------------------------------------------------


async def pool_instances(request: web.Request) -> web.Response:
    spec = lookup_pipeline(request.match_info["pipeline"])
    stage_id = int_param(request.match_info["stage_id"], "stage_id", low=0, high=MAX_STAGE_ID)
    lookup_stage(spec, stage_id)
    include_all = bool_param(request.query.get("all", "0"), "all")
    snapshot = await request.app[appkeys.STORE].pool(
        spec.name, stage_id, healthy_only=not include_all
    )
    return _json(snapshot)


async def pipelines(request: web.Request) -> web.Response:
    store = request.app[appkeys.STORE]
    desired = await routes_scale.desired_counts(request.app)
    statuses: list[PipelineStatus] = []
    for name in sorted({*await store.pipeline_names(), *desired}):
        try:
            status = await store.pipeline_status(get_pipeline(name))
        except UnknownPipelineError:
            continue
        if status.instances or status.api_servers or name in desired:
            pools = desired.get(name, {})
            counts = {
                "desired": pools.get(ScalePool.STAGE, {}),
                "prefill_desired": pools.get(ScalePool.PREFILL, {}),
            }
            statuses.append(status.model_copy(update=counts))
    return _json(PipelineList(pipelines=tuple(statuses)))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/instances", register)
    app.router.add_put("/v1/instances/{id}/heartbeat", heartbeat)
    app.router.add_delete("/v1/instances/{id}", deregister)
    app.router.add_post("/v1/instances/{id}/isolate", isolate)
    app.router.add_post("/v1/instances/{id}/readmit", readmit)
    app.router.add_post("/v1/instances/{id}/drain", drain)
    app.router.add_post("/v1/instances/{id}/promote", promote)
    app.router.add_post("/v1/instances/{id}/suspect", suspect)
    app.router.add_get("/v1/pipelines", pipelines)
    app.router.add_get("/v1/pipelines/{pipeline}/stages/{stage_id}/instances", pool_instances)
    app.router.add_get("/v1/watch", watch.watch)
    routes_scale.add_routes(app)
    routes_sessions.add_routes(app)
