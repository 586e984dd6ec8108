"""Autoscaling state in Redis (in-process, the session Redis): only the sweeper-lock holder's
decisions are stored, a decision made on a policy that changed meanwhile is dropped, a repeated
PUT keeps the decision, the autoscaler decides every autoscaled stage, and a stored policy leaves
its unset knobs out (a control plane that predates a knob still reads it)."""

from __future__ import annotations

import json

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.autoscaling.autoscaler import Autoscaler, refresh_gauges
from omni_mesh.control_plane.autoscaling.policy import initial_decision
from omni_mesh.control_plane.schema import (
    ENGINE_QUEUE_WAIT_MS,
    LoadReport,
    RegisterRequest,
    ScaleInputs,
)
from omni_mesh.control_plane.store.instances import InstanceStore
from omni_mesh.control_plane.store.keys import KeySchema
from omni_mesh.observability.metrics import ControlPlaneMetrics

pytestmark = pytest.mark.unit

KEYS = KeySchema()
POLICY = AutoscaleConfig(min_replicas=0, max_replicas=4, target_utilization=0.5, cooldown_s=0)


def make_store(client: redis.asyncio.Redis) -> InstanceStore:
    return InstanceStore(client, KEYS, lease_ttl_ms=3000, evict_after_ms=60_000)


async def test_only_the_lock_holder_stores_decisions(redis_client: redis.asyncio.Redis) -> None:
    scale = make_store(redis_client).scale
    now = await scale.now_ms()
    assert await scale.put_policy(
        "synthetic", 1, POLICY, initial_decision(POLICY, ScaleInputs(), now, 2)
    )
    stored = await scale.stage("synthetic", 1)
    assert stored is not None and stored.decision is not None and stored.decision.desired == 2
    later = stored.decision.model_copy(update={"desired": 3})

    assert await scale.save_decision("not-the-holder", stored, later) == 0
    assert await redis_client.set(KEYS.sweeper_lock, "holder")
    assert await scale.save_decision("holder", stored, later) == 1
    again = await scale.stage("synthetic", 1)
    assert again is not None and again.decision is not None and again.decision.desired == 3

    # A repeated PUT keeps the decision; a decision made on the old policy is then dropped.
    changed = POLICY.model_copy(update={"max_replicas": 2})
    assert not await scale.put_policy(
        "synthetic", 1, changed, initial_decision(changed, ScaleInputs(), now, 1)
    )
    assert await scale.save_decision("holder", stored, later) == -1
    assert await scale.stages() == [("synthetic", 1)]
    assert await scale.delete_policy("synthetic", 1)
    assert await scale.stage("synthetic", 1) is None and await scale.stages() == []
    assert not await scale.delete_policy("synthetic", 1)


async def test_the_autoscaler_decides_from_heartbeats(redis_client: redis.asyncio.Redis) -> None:
    store = make_store(redis_client)
    metrics = ControlPlaneMetrics(CollectorRegistry())
    autoscaler = Autoscaler(store, store.scale, metrics.autoscale)
    assert await autoscaler.tick("holder") == []  # nothing autoscaled: nothing read
    reg = await store.register(
        RegisterRequest(
            pipeline="synthetic", stage_id=2, address="http://127.0.0.1:9901", capacity=10
        )
    )
    load = LoadReport(in_flight=10, capacity=10, engine={ENGINE_QUEUE_WAIT_MS: 250.0})
    await store.heartbeat(reg.instance_id, load)
    now = await store.scale.now_ms()
    fast = POLICY.model_copy(update={"scale_up_window_s": 0.0})
    await store.scale.put_policy(
        "synthetic", 2, fast, initial_decision(fast, ScaleInputs(), now, 1)
    )
    await store.scale.wake("synthetic", 2, 3)

    assert await autoscaler.tick("holder") == []  # the lock is not held: nothing stored
    await redis_client.set(KEYS.sweeper_lock, "holder")
    [decision] = await autoscaler.tick("holder")
    assert (decision.previous, decision.desired, decision.reason) == (1, 2, "utilization")
    assert decision.inputs.wake_waiting == 3 and decision.leader == "holder"
    await refresh_gauges(store.scale, metrics.autoscale)
    registry = metrics.registry
    labels = {"pipeline": "synthetic", "stage": "2"}
    assert registry.get_sample_value("omni_cp_desired_replicas", labels) == 2.0
    assert registry.get_sample_value("omni_cp_stage_utilization", labels) == 1.0
    assert registry.get_sample_value("omni_cp_stage_queue_wait_seconds", labels) == 0.25
    assert (
        registry.get_sample_value(
            "omni_cp_scale_decisions_total", {**labels, "direction": "up", "reason": "utilization"}
        )
        == 1.0
    )


async def test_a_served_wake_hint_does_not_wake_the_stage_again(
    redis_client: redis.asyncio.Redis,
) -> None:
    """A stage woken from zero gets a replica; the hint is then cleared, so when that replica
    leaves (drained, idle) the stage stays at zero instead of starting one for requests that
    were already served (the replica-flapping of omni-up's actuator test)."""
    store = make_store(redis_client)
    autoscaler = Autoscaler(store, store.scale, ControlPlaneMetrics(CollectorRegistry()).autoscale)
    await redis_client.set(KEYS.sweeper_lock, "holder")
    now = await store.scale.now_ms()
    quick = POLICY.model_copy(update={"scale_down_window_s": 0.0})
    await store.scale.put_policy(
        "synthetic", 3, quick, initial_decision(quick, ScaleInputs(), now, 0)
    )
    await store.scale.wake("synthetic", 3, 1)
    [woken] = await autoscaler.tick("holder")
    assert (woken.previous, woken.desired, woken.reason) == (0, 1, "wake")

    reg = await store.register(
        RegisterRequest(
            pipeline="synthetic", stage_id=3, address="http://127.0.0.1:9903", capacity=4
        )
    )
    [serving] = await autoscaler.tick("holder")
    assert serving.inputs.ready == 1 and serving.inputs.wake_waiting == 1
    stored = await store.scale.stage("synthetic", 3)
    assert stored is not None and stored.wake_waiting == 0  # served: cleared

    await store.deregister(reg.instance_id)
    [gone] = await autoscaler.tick("holder")
    assert gone.inputs.ready == 0 and gone.inputs.wake_waiting == 0
    assert gone.desired == 0 and gone.reason != "wake"

    await store.scale.wake("synthetic", 3, 1)  # a new waiter wakes it again
    [again] = await autoscaler.tick("holder")
    assert (again.desired, again.reason) == (1, "wake")


async def test_a_stored_policy_leaves_its_unset_knobs_out(
    redis_client: redis.asyncio.Redis,
) -> None:
    # A control plane that predates a knob (target_queue_wait_ms) refuses a stored policy that
    # names it, null or not: unset, it is left out, and every control plane reads the policy.
    scale = make_store(redis_client).scale
    now = await scale.now_ms()
    await scale.put_policy("synthetic", 7, POLICY, initial_decision(POLICY, ScaleInputs(), now, 1))
    try:
        raw = await redis_client.get(KEYS.scale_policy("synthetic", 7))
        assert isinstance(raw, str)
        stored = json.loads(raw)
        assert "target_queue_wait_ms" not in stored and "target_latency_ms" not in stored
        assert AutoscaleConfig.model_validate_json(raw) == POLICY
        waits = POLICY.model_copy(update={"target_queue_wait_ms": 200.0})
        await scale.put_policy("synthetic", 7, waits, initial_decision(waits, ScaleInputs(), now))
        got = await scale.stage("synthetic", 7)
        assert got is not None and got.policy.target_queue_wait_ms == 200.0
    finally:
        await scale.delete_policy("synthetic", 7)
