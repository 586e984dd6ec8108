"""Autoscaling state in Redis (in-process, the session Redis): only the sweeper-lock holder's
decisions are stored, a decision made on a policy that changed meanwhile is dropped, a repeated
PUT keeps the decision, the autoscaler decides every autoscaled stage, a stored policy leaves
its unset knobs out (a control plane that predates a knob still reads it), and a first-audio
target reads the pipeline's API servers."""

from __future__ import annotations

import json

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.autoscaling.autoscaler import Autoscaler, refresh_gauges
from omni_mesh.control_plane.autoscaling.policy import initial_decision
from omni_mesh.control_plane.schema import (
    ENGINE_FIRST_AUDIO_COUNT,
    ENGINE_FIRST_AUDIO_LE,
    ENGINE_QUEUE_WAIT_MS,
    LoadReport,
    RegisterRequest,
    ScaleInputs,
)
from omni_mesh.control_plane.store.instances import InstanceStore, StateAction
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


RTF_WINDOW = {"rtf_le_0.5": 5.0, "rtf_le_2": 25.0, "rtf_count": 25.0}


def _window(answers_at: dict[float, int]) -> dict[str, float]:
    """An API server's first-audio window: ``answers_at`` answers per bucket bound."""
    figures, running = {}, 0
    for bound, count in sorted(answers_at.items()):
        running += count
        figures[f"{ENGINE_FIRST_AUDIO_LE}{bound:g}"] = float(running)
    figures[ENGINE_FIRST_AUDIO_COUNT] = float(running)
    return figures


async def test_a_first_audio_target_reads_the_pipelines_api_servers(
    redis_client: redis.asyncio.Redis,
) -> None:
    # tiny-tts: its talker (stage 0) targets a 300 ms first-audio p95. Its API servers are an
    # --api-only server and a talker pod that serves the API too (label role=api); a headless
    # talker's figures, an isolated API server's and another pipeline's do not count.
    store = make_store(redis_client)
    metrics = ControlPlaneMetrics(CollectorRegistry())
    autoscaler = Autoscaler(store, store.scale, metrics.autoscale)
    await redis_client.set(KEYS.sweeper_lock, "holder")

    async def joined(stage: int, port: int, role: str, window: dict[str, float], **kw: str) -> str:
        reg = await store.register(
            RegisterRequest(
                pipeline=kw.get("pipeline", "tiny-tts"), stage_id=stage, capacity=4,
                address=f"http://127.0.0.1:{port}", labels={"role": role},
                role="api" if role == "api-only" else "stage",
            ), stage_ids=(0, 1),
        )  # fmt: skip
        engine = {"running": 1.0, "max_num_seqs": 4.0, "occupancy": 2.0, **window}
        await store.heartbeat(reg.instance_id, LoadReport(in_flight=2, capacity=4, engine=engine))
        return reg.instance_id

    await joined(0, 9911, "api-only", {**_window({0.1: 10, 0.5: 5}), **RTF_WINDOW})
    await joined(0, 9912, "api", _window({1.0: 10}))
    await joined(0, 9913, "headless", _window({0.1: 100}))  # not an API server: not read
    isolated = await joined(0, 9914, "api-only", _window({0.1: 100}))
    await store.set_state(isolated, StateAction.ISOLATE)
    await joined(0, 9915, "api-only", _window({0.1: 100}), pipeline="tiny-omni")
    servers = await store.api_servers("tiny-tts", (0, 1))
    assert sorted(i.address[-4:] for i in servers) == ["9911", "9912"]

    now = await store.scale.now_ms()
    target = POLICY.model_copy(
        update={"scale_up_window_s": 0.0, "target_utilization": 1.0,
                "target_first_audio_p95_ms": 300.0}
    )  # fmt: skip
    await store.scale.put_policy(
        "tiny-tts", 0, target, initial_decision(target, ScaleInputs(), now)
    )
    [decision] = await autoscaler.tick("holder")
    # 25 answers, rank 23.75 in (0.5, 1.0]: 0.5 + 0.5 x 8.75 / 10 = 0.9375 s; 2 talkers (9912,
    # 9913 are in the pool) x 937.5 / 300 -> 7, bounded by max_replicas 4.
    assert decision.inputs.first_audio_samples == 25
    assert decision.inputs.first_audio_p95_ms == pytest.approx(937.5)
    assert (decision.recommended, decision.desired, decision.reason) == (4, 4, "first_audio")
    await refresh_gauges(store.scale, metrics.autoscale)
    p95 = metrics.registry.get_sample_value(
        "omni_cp_stage_first_audio_p95_seconds", {"pipeline": "tiny-tts", "stage": "0"}
    )
    assert p95 == pytest.approx(0.9375)
    # The real-time factor's p5 is read too (rank 1.25, 5 answers in (0, 0.5]: 0.125).
    assert decision.inputs.realtime_factor_p5 == pytest.approx(0.125)
    rtf = metrics.registry.get_sample_value(
        "omni_cp_stage_realtime_factor_p5", {"pipeline": "tiny-tts", "stage": "0"}
    )
    assert rtf == pytest.approx(0.125)
    # A pool that does not target it reads no API server.
    await store.scale.put_policy(
        "tiny-tts", 1, POLICY, initial_decision(POLICY, ScaleInputs(), now)
    )
    p95s = sorted((d.inputs.first_audio_p95_ms or 0.0) for d in await autoscaler.tick("holder"))
    assert p95s == [0.0, pytest.approx(937.5)]
    for stage in (0, 1):
        await store.scale.delete_policy("tiny-tts", stage)
