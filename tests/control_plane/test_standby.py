"""Warm standby replicas in the store and the autoscaler (the session Redis): a standby is
listed but never routed to, keeps its standby state through a lapsed lease, and the autoscaler
promotes one in the tick that finds the pool short of its desired count; an operator can too."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.autoscaling.autoscaler import Autoscaler, refresh_gauges
from omni_mesh.control_plane.autoscaling.policy import initial_decision
from omni_mesh.control_plane.client import ControlPlaneClient
from omni_mesh.control_plane.schema import InstanceState, LoadReport, RegisterRequest, ScaleInputs
from omni_mesh.control_plane.status import render_status
from omni_mesh.control_plane.store.instances import InstanceStore, StateAction
from omni_mesh.control_plane.store.keys import KeySchema
from omni_mesh.observability.metrics import ControlPlaneMetrics

pytestmark = pytest.mark.unit

KEYS = KeySchema()
PIPELINE = "synthetic"


def make_store(client: redis.asyncio.Redis, lease_ttl_ms: int = 3000) -> InstanceStore:
    return InstanceStore(client, KEYS, lease_ttl_ms=lease_ttl_ms, evict_after_ms=60_000)


def request(stage_id: int, port: int, *, standby: bool) -> RegisterRequest:
    return RegisterRequest(
        pipeline=PIPELINE,
        stage_id=stage_id,
        address=f"http://127.0.0.1:{port}",
        capacity=4,
        standby=standby,
    )


async def autoscaled(
    client: redis.asyncio.Redis, store: InstanceStore, stage_id: int, *, standby_replicas: int
) -> tuple[Autoscaler, ControlPlaneMetrics]:
    """An autoscaler holding the sweeper lock, and a quick policy (1..4 replicas, no windows)
    set for ``stage_id``."""
    metrics = ControlPlaneMetrics(CollectorRegistry())
    await client.set(KEYS.sweeper_lock, "holder")
    policy = AutoscaleConfig(
        min_replicas=1,
        max_replicas=4,
        target_utilization=0.5,
        scale_up_window_s=0.0,
        cooldown_s=0.0,
        standby_replicas=standby_replicas,
    )
    now = await store.scale.now_ms()
    first = initial_decision(policy, ScaleInputs(), now, 1)
    await store.scale.put_policy(PIPELINE, stage_id, policy, first)
    return Autoscaler(store, store.scale, metrics.autoscale), metrics


async def states(store: InstanceStore, stage_id: int) -> dict[str, InstanceState]:
    pool = await store.pool(PIPELINE, stage_id, healthy_only=False)
    return {i.instance_id: i.state for i in pool.instances}


async def routed(store: InstanceStore, stage_id: int) -> set[str]:
    pool = await store.pool(PIPELINE, stage_id, healthy_only=True)
    return {i.instance_id for i in pool.instances}


async def test_a_standby_is_listed_but_routed_only_once_promoted(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    serving = await store.register(request(1, 9801, standby=False))
    standby = await store.register(request(1, 9802, standby=True))
    assert await states(store, 1) == {
        serving.instance_id: InstanceState.HEALTHY,
        standby.instance_id: InstanceState.STANDBY,
    }
    assert await routed(store, 1) == {serving.instance_id}
    before = (await store.pool(PIPELINE, 1, healthy_only=True)).version

    promoted = await store.set_state(standby.instance_id, StateAction.PROMOTE)
    assert promoted is not None and promoted.changed and promoted.state is InstanceState.HEALTHY
    after = await store.pool(PIPELINE, 1, healthy_only=True)
    assert after.version > before  # watchers hear of it like any pool change
    assert {i.instance_id for i in after.instances} == {serving.instance_id, standby.instance_id}
    again = await store.set_state(standby.instance_id, StateAction.PROMOTE)
    assert again is not None and not again.changed
    # Promoting what is not a standby changes nothing (a draining replica stays draining).
    await store.set_state(serving.instance_id, StateAction.DRAIN, "leaving")
    kept = await store.set_state(serving.instance_id, StateAction.PROMOTE)
    assert kept is not None and not kept.changed and kept.state is InstanceState.DRAINING


async def test_a_standby_back_from_a_lapsed_lease_is_a_standby_again(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client, lease_ttl_ms=100)
    standby = await store.register(request(2, 9811, standby=True))
    promoted = await store.register(request(2, 9812, standby=True))
    await store.set_state(promoted.instance_id, StateAction.PROMOTE)
    await asyncio.sleep(0.2)
    await redis_client.set(KEYS.sweeper_lock, "holder")
    swept = await store.sweep("holder", lock_ttl_ms=2000, limit=100)
    assert {e.instance_id for e in swept.events} == {standby.instance_id, promoted.instance_id}
    assert set((await states(store, 2)).values()) == {InstanceState.ISOLATED}

    ack = await store.heartbeat(standby.instance_id, LoadReport(capacity=4))
    assert ack is not None and ack.state is InstanceState.STANDBY and ack.revived
    ack = await store.heartbeat(promoted.instance_id, LoadReport(capacity=4))
    assert ack is not None and ack.state is InstanceState.HEALTHY  # promoted stays promoted
    assert await routed(store, 2) == {promoted.instance_id}
    # An operator's readmit of an isolated standby also returns it to standby.
    await store.set_state(standby.instance_id, StateAction.ISOLATE, "operator")
    back = await store.set_state(standby.instance_id, StateAction.READMIT)
    assert back is not None and back.state is InstanceState.STANDBY


async def test_the_autoscaler_promotes_a_standby_in_the_tick_that_needs_it(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    autoscaler, metrics = await autoscaled(redis_client, store, 3, standby_replicas=2)
    serving = await store.register(request(3, 9821, standby=False))
    first = await store.register(request(3, 9822, standby=True))
    second = await store.register(request(3, 9823, standby=True))
    await store.heartbeat(serving.instance_id, LoadReport(in_flight=4, capacity=4))

    [decision] = await autoscaler.tick("holder")
    assert (decision.previous, decision.desired) == (1, 2)
    assert decision.inputs.ready == 1 and decision.inputs.standby == 2
    # The oldest standby serves from this tick on; the other one waits.
    assert await routed(store, 3) == {serving.instance_id, first.instance_id}
    assert (await states(store, 3))[second.instance_id] is InstanceState.STANDBY
    labels = {"pipeline": PIPELINE, "stage": "3"}
    registry = metrics.registry
    assert registry.get_sample_value("omni_cp_standby_promotions_total", labels) == 1.0

    # A serving replica lost: the desired count holds, and the last standby takes its place.
    await store.deregister(serving.instance_id)
    await store.heartbeat(first.instance_id, LoadReport(in_flight=1, capacity=4))
    [held] = await autoscaler.tick("holder")
    assert held.desired == 2 and held.inputs.ready == 1
    assert await routed(store, 3) == {first.instance_id, second.instance_id}
    assert registry.get_sample_value("omni_cp_standby_promotions_total", labels) == 2.0
    await refresh_gauges(store.scale, metrics.autoscale)
    assert registry.get_sample_value("omni_cp_standby_replicas", labels) == 1.0  # at deciding


async def test_an_operator_promotes_a_standby_over_the_api(
    fast_client: ControlPlaneClient,
) -> None:
    """Through a real omni-cp: a standby registration shows in ``?all=1`` (state standby) and in
    ``omni-cp status`` but not in the pool; ``POST …/promote`` puts it there; a heartbeat then
    answers healthy."""
    req = request(2, 9841, standby=True).model_copy(update={"pipeline": "tiny-omni"})
    reg = await fast_client.register(req)
    try:
        listed = await fast_client.instances("tiny-omni", 2, all=True)
        assert [(i.instance_id, i.state) for i in listed.instances] == [
            (reg.instance_id, InstanceState.STANDBY)
        ]
        assert (await fast_client.instances("tiny-omni", 2)).instances == ()
        table = render_status(await fast_client.pipelines(), pipeline="tiny-omni")
        assert any(reg.instance_id in line and " standby " in line for line in table.splitlines())
        info = await fast_client.promote(reg.instance_id)
        assert info.state is InstanceState.HEALTHY
        pool = await fast_client.instances("tiny-omni", 2)
        assert [i.instance_id for i in pool.instances] == [reg.instance_id]
        ack = await fast_client.heartbeat(reg.instance_id, LoadReport(capacity=4))
        assert ack.state is InstanceState.HEALTHY
    finally:
        await fast_client.deregister(reg.instance_id)


async def test_a_split_stage_scales_its_decode_pool_only(
    redis_client: redis.asyncio.Redis,
) -> None:
    # A split stage (deploy prefill:): its prefill replicas register with kv_role prefill and
    # are neither counted as ready nor promoted; the policy sizes the decode pool.
    store = make_store(redis_client)
    autoscaler, _ = await autoscaled(redis_client, store, 4, standby_replicas=0)
    pools = {"prefill": 9841, "decode": 9842}
    ids = {}
    for role, port in pools.items():
        req = request(4, port, standby=False).model_copy(update={"labels": {"kv_role": role}})
        ids[role] = (await store.register(req)).instance_id
    # The prefill replica is busy and the decode one idle: nothing to add to the decode pool.
    await store.heartbeat(ids["prefill"], LoadReport(in_flight=4, capacity=4))
    await store.heartbeat(ids["decode"], LoadReport(in_flight=0, capacity=4))
    [decision] = await autoscaler.tick("holder")
    assert decision.inputs.ready == 1 and decision.desired == 1
    # The decode replica busy: the decode pool grows, counted without the prefill replica.
    await store.heartbeat(ids["decode"], LoadReport(in_flight=4, capacity=4))
    [grown] = await autoscaler.tick("holder")
    assert grown.inputs.ready == 1 and grown.desired == 2
