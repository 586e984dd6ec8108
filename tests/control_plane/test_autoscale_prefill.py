"""A split stage's prefill pool autoscales apart from its decode pool (deploy
``prefill: {autoscale: …}``): its own policy and decision under the ``pool=prefill`` variant of
the scale keys and routes, decided from the figures of the replicas labelled
``kv_role=prefill`` only, while the stage's own policy keeps sizing the decode pool from the
others. In the store and the autoscaler (the session Redis, keys under a prefix of their own),
then through a real omni-cp (embedded Redis): the ``?pool=prefill`` routes, what they refuse,
``omni-cp status`` and the gauges."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.autoscaling.autoscaler import Autoscaler, refresh_gauges
from omni_mesh.control_plane.autoscaling.policy import initial_decision
from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    ControlPlaneRequestError,
    LoadReport,
    RegisterRequest,
    ScalePool,
    ScaleStatus,
)
from omni_mesh.control_plane.schema import InstanceState, ScaleInputs
from omni_mesh.control_plane.status import render_status
from omni_mesh.control_plane.store.instances import InstanceStore
from omni_mesh.control_plane.store.keys import KeySchema
from omni_mesh.observability.metrics import ControlPlaneMetrics
from tests.control_plane.scaling import heartbeating, until
from tests.procs import ControlPlaneProcess, start_control_plane

PIPELINE = "tiny-llm"
FAST = AutoscaleConfig(
    min_replicas=1,
    max_replicas=4,
    target_utilization=0.5,
    scale_up_window_s=0.0,
    scale_down_window_s=0.0,
    cooldown_s=0.0,
    max_scale_down_step=4,
)


def split_request(port: int, role: str, *, standby: bool = False) -> RegisterRequest:
    return RegisterRequest(
        pipeline=PIPELINE,
        stage_id=0,
        address=f"http://127.0.0.1:{port}",
        capacity=4,
        labels={"kv_role": role},
        standby=standby,
    )


# ---- the keys, the store and the autoscaler --------------------------------------------------


@pytest.mark.unit
def test_a_prefill_pool_has_scale_keys_of_its_own() -> None:
    keys = KeySchema()
    assert keys.scale_policy("p", 0) == "omni:scale:policy:p:0"  # the stage's, unchanged
    assert keys.scale_policy("p", 0, ScalePool.PREFILL) == "omni:scale:policy:p:0:prefill"
    assert keys.scale_decision("p", 0, ScalePool.PREFILL) == "omni:scale:decision:p:0:prefill"
    assert keys.scale_wake("p", 0, ScalePool.PREFILL) == "omni:scale:wake:p:0:prefill"
    for pipeline in ("p", "a:1", "a:1:prefill"):  # a pipeline name may hold colons
        for pool in ScalePool:
            member = keys.scale_member(pipeline, 3, pool)
            assert keys.parse_scale_member(member) == (pipeline, 3, pool)
    assert keys.parse_scale_member("p:x:prefill") is None
    assert keys.parse_scale_member(":prefill") is None


@pytest.mark.unit
async def test_the_autoscaler_sizes_each_pool_from_its_own_replicas(
    redis_client: redis.asyncio.Redis,
) -> None:
    keys = KeySchema(prefix="test-prefill-pool:")
    store = InstanceStore(redis_client, keys, lease_ttl_ms=3000, evict_after_ms=60_000)
    metrics = ControlPlaneMetrics(CollectorRegistry())
    autoscaler = Autoscaler(store, store.scale, metrics.autoscale)
    await redis_client.set(keys.sweeper_lock, "holder")
    try:
        now = await store.scale.now_ms()
        first = initial_decision(FAST, ScaleInputs(), now, 1)
        await store.scale.put_policy(PIPELINE, 0, FAST, first)
        await store.scale.put_policy(PIPELINE, 0, FAST, first, ScalePool.PREFILL)
        assert await store.scale.pools() == [
            (PIPELINE, 0, ScalePool.STAGE),
            (PIPELINE, 0, ScalePool.PREFILL),
        ]
        assert await store.scale.stages() == [(PIPELINE, 0)]  # the stages' own pools only
        prefill = await store.register(split_request(9861, "prefill"))
        decode = await store.register(split_request(9862, "decode"))
        spare = await store.register(split_request(9863, "prefill", standby=True))

        # Prompts pile up on the prefill replica while the decode one idles: only the prefill
        # pool grows, and its standby is promoted into it (not into the decode pool).
        await store.heartbeat(prefill.instance_id, LoadReport(in_flight=4, capacity=4))
        await store.heartbeat(decode.instance_id, LoadReport(in_flight=1, capacity=4))
        stage, pre = await autoscaler.tick("holder")
        assert (stage.inputs.ready, stage.inputs.utilization, stage.desired) == (1, 0.25, 1)
        assert (pre.inputs.ready, pre.inputs.utilization, pre.inputs.standby) == (1, 1.0, 1)
        assert (pre.previous, pre.desired, pre.reason) == (1, 2, "utilization")
        pool = await store.pool(PIPELINE, 0, healthy_only=False)
        states = {i.instance_id: i.state for i in pool.instances}
        assert states[spare.instance_id] is InstanceState.HEALTHY

        # Then the other way round: the decode pool grows, the prefill pool shrinks.
        for reg, busy in ((prefill, 0), (spare, 0), (decode, 4)):
            await store.heartbeat(reg.instance_id, LoadReport(in_flight=busy, capacity=4))
        stage, pre = await autoscaler.tick("holder")
        assert (stage.inputs.ready, stage.desired) == (1, 2)
        assert (pre.inputs.ready, pre.desired, pre.reason) == (2, 1, "idle")

        stored = await store.scale.stage(PIPELINE, 0, ScalePool.PREFILL)
        assert stored is not None and stored.decision is not None and stored.decision.desired == 1
        await refresh_gauges(store.scale, metrics.autoscale)
        registry = metrics.registry
        for stage_label, desired in (("0", 2.0), ("0/prefill", 1.0)):
            labels = {"pipeline": PIPELINE, "stage": stage_label}
            assert registry.get_sample_value("omni_cp_desired_replicas", labels) == desired
        labels = {"pipeline": PIPELINE, "stage": "0/prefill"}
        assert registry.get_sample_value("omni_cp_standby_promotions_total", labels) == 1.0

        # Forgetting one pool's policy leaves the other's.
        assert await store.scale.delete_policy(PIPELINE, 0, ScalePool.PREFILL)
        assert await store.scale.pools() == [(PIPELINE, 0, ScalePool.STAGE)]
        assert await store.scale.stage(PIPELINE, 0) is not None
    finally:
        await redis_client.delete(*[k async for k in redis_client.scan_iter(f"{keys.prefix}*")])


# ---- through omni-cp ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    """One omni-cp on an embedded Redis of its own (sweep every 100 ms; leases and the lock
    last 10 s, so a stalled test process on a loaded machine costs no replica)."""
    proc = start_control_plane(
        None,
        heartbeat_interval_ms=200,
        lease_ttl_ms=10_000,
        sweep_interval_ms=100,
        extra_args=["--sweeper-lock-ttl-ms", "10000"],
        log_dir=tmp_path_factory.mktemp("omni-cp-prefill"),
        name="omni-cp-prefill",
    )
    yield proc
    proc.proc.cleanup()


@pytest.fixture
async def client(cp: ControlPlaneProcess) -> AsyncIterator[ControlPlaneClient]:
    c = ControlPlaneClient([cp.url], timeout_s=5.0)
    yield c
    for pool in ScalePool:
        with contextlib.suppress(ControlPlaneRequestError):
            await c.remove_scale_policy(PIPELINE, 0, pool=pool)
    await c.close()


@contextlib.asynccontextmanager
async def split_stage(
    client: ControlPlaneClient, load: dict[str, int]
) -> AsyncIterator[dict[str, str]]:
    """One prefill and one decode replica of stage 0, heartbeating ``load[role]`` of
    capacity 4 every 200 ms until the block ends (then they leave)."""
    ids = {}
    for port, role in ((9871, "prefill"), (9872, "decode")):
        ids[role] = (await client.register(split_request(port, role))).instance_id

    def reports() -> dict[str, LoadReport]:
        return {i: LoadReport(in_flight=load[role], capacity=4) for role, i in ids.items()}

    async with heartbeating(client, reports):
        yield ids


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_the_prefill_pool_scales_apart_through_omni_cp(
    cp: ControlPlaneProcess, client: ControlPlaneClient
) -> None:
    load = {"prefill": 1, "decode": 1}
    async with split_stage(client, load) as ids:
        stage = await client.set_scale_policy(PIPELINE, 0, FAST, replicas=1)
        prefill_policy = FAST.model_copy(update={"max_replicas": 3})
        pre = await client.set_scale_policy(
            PIPELINE, 0, prefill_policy, replicas=1, pool=ScalePool.PREFILL
        )
        assert (stage.pool, stage.ready, stage.desired) == (ScalePool.STAGE, 1, 1)
        assert (pre.pool, pre.ready, pre.desired) == (ScalePool.PREFILL, 1, 1)
        assert pre.policy == prefill_policy

        load["prefill"] = 4  # the prefill replica saturated (twice the target), the decode light
        grown = await until(
            lambda: client.scale(PIPELINE, 0, pool=ScalePool.PREFILL), lambda s: s.desired == 2
        )
        assert grown.decision is not None and grown.decision.inputs.ready == 1
        assert grown.decision.inputs.utilization == pytest.approx(1.0)
        held = await client.scale(PIPELINE, 0)  # the decode pool: its own figures only
        assert held.desired == 1 and held.decision is not None
        assert held.decision.inputs.utilization == pytest.approx(0.25)

        # omni-cp status: each replica's DESIRED is its own pool's.
        table = render_status(await client.pipelines(), pipeline=PIPELINE)
        rows = {line.split()[3]: line.split() for line in table.splitlines()[1:]}
        assert rows[ids["prefill"]][2].endswith("/prefill")
        assert rows[ids["prefill"]][-1] == "2" and rows[ids["decode"]][-1] == "1"
        async with aiohttp.ClientSession() as session, session.get(f"{cp.url}/metrics") as resp:
            text = await resp.text()
        assert 'omni_cp_desired_replicas{pipeline="tiny-llm",stage="0/prefill"} 2.0' in text
        assert 'omni_cp_desired_replicas{pipeline="tiny-llm",stage="0"} 1.0' in text

        # Forgetting the prefill pool's policy leaves the stage's.
        await client.remove_scale_policy(PIPELINE, 0, pool=ScalePool.PREFILL)
        gone = await client.scale(PIPELINE, 0, pool=ScalePool.PREFILL)
        assert (gone.policy, gone.desired, gone.ready) == (None, None, 1)
        assert (await client.scale(PIPELINE, 0)).policy == FAST
    assert "autoscale up pipeline=tiny-llm stage=0 pool=prefill desired=1->2" in cp.proc.stderr


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("method", "query", "body", "status", "field"),
    [
        ("GET", "?pool=nope", None, 400, "pool"),
        ("PUT", "?pool=prefill", {"autoscale": {"min_replicas": 0}}, 400,
         "autoscale.min_replicas"),
        ("DELETE", "?pool=prefill", None, 404, "stage_id"),
        ("POST", "/wake?pool=prefill", None, 404, "stage_id"),
    ],
)  # fmt: skip
async def test_bad_prefill_pool_requests_name_the_field(
    cp: ControlPlaneProcess,
    method: str,
    query: str,
    body: object,
    status: int,
    field: str,
) -> None:
    url = f"{cp.url}/v1/pipelines/{PIPELINE}/stages/0/scale{query}"
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, json=body) as resp,
    ):
        assert resp.status == status, await resp.text()
        error = (await resp.json())["error"]
        assert error["param"] == field, error
        if status == 404:
            assert "prefill pool" in error["message"] and "?pool=prefill" in error["message"]


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_decode_names_the_stage_pool(
    client: ControlPlaneClient, cp: ControlPlaneProcess
) -> None:
    # a scale-down window the test outlives: the policy does not move desired off 2 (with FAST's
    # none, a decision that lands between the two calls on a busy machine brings it to 1)
    hold = FAST.model_copy(update={"scale_down_window_s": 3600.0})
    await client.set_scale_policy(PIPELINE, 0, hold, replicas=2)
    url = f"{cp.url}/v1/pipelines/{PIPELINE}/stages/0/scale?pool=decode"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200
        status = ScaleStatus.model_validate_json(await resp.read())
    assert (status.pool, status.desired) == (ScalePool.STAGE, 2)
