"""The autoscaling policy as pure functions: inputs from heartbeats, the recommendation,
hysteresis (windows, step limits, cooldown), min/max, scale to zero and back, no flapping."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping
from pathlib import Path

import pytest
from pydantic import ValidationError

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.deploy import DeployConfigError, StageDeployConfig
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.autoscaling import policy as policy_mod
from omni_mesh.control_plane.autoscaling.audio_slo import (
    MIN_SAMPLES,
    first_audio_p95,
    realtime_factor_p5,
)
from omni_mesh.control_plane.autoscaling.policy import (
    MAX_HISTORY,
    decide,
    initial_decision,
    recommend,
    replica_figures,
    stage_inputs,
)
from omni_mesh.control_plane.schema import (
    ENGINE_OCCUPANCY,
    ENGINE_QUEUE_WAIT_MS,
    InstanceInfo,
    InstanceState,
    LoadReport,
    ScaleDecision,
    ScaleDirection,
    ScaleInputs,
)

pytestmark = pytest.mark.unit

T0 = 1_000_000


def replica(
    in_flight: int = 0,
    *,
    queued: int = 0,
    capacity: int = 10,
    engine: Mapping[str, float] | None = None,
    n: int = 0,
) -> InstanceInfo:
    return InstanceInfo(
        instance_id=f"r{n}",
        pipeline="synthetic",
        stage_id=1,
        address=f"http://127.0.0.1:{9000 + n}",
        host_id="h",
        capacity=capacity,
        state=InstanceState.HEALTHY,
        epoch=1,
        registered_at_ms=0,
        last_heartbeat_ms=0,
        heartbeat_age_ms=0,
        load=LoadReport(
            in_flight=in_flight, queued=queued, capacity=capacity, engine=dict(engine or {})
        ),
    )


def pool(*in_flight: int, capacity: int = 10) -> ScaleInputs:
    return stage_inputs([replica(f, capacity=capacity, n=i) for i, f in enumerate(in_flight)])


def loaded(replicas: int, utilization: float, capacity: int = 10) -> ScaleInputs:
    """A pool of ``replicas`` replicas at ``utilization`` each."""
    per = round(utilization * capacity)
    return pool(*([per] * replicas), capacity=capacity)


def policy(**kw: object) -> AutoscaleConfig:
    base: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 8,
        "target_utilization": 0.5,
        "scale_up_window_s": 3.0,
        "scale_down_window_s": 30.0,
        "cooldown_s": 0.0,
        "max_scale_up_step": 8,
    }
    return AutoscaleConfig.model_validate({**base, **kw})


def run(
    p: AutoscaleConfig,
    start: ScaleDecision,
    loads: list[ScaleInputs],
    step_ms: int = 1000,
) -> list[ScaleDecision]:
    """Decide once per ``step_ms`` for each entry of ``loads``; the decisions, in order."""
    out, d = [], start
    for k, inputs in enumerate(loads):
        d = decide(p, inputs, d, start.decided_at_ms + (k + 1) * step_ms)
        out.append(d)
    return out


# ---- inputs ---------------------------------------------------------------------------------


def test_utilization_is_in_flight_over_capacity() -> None:
    assert replica_figures(replica(3, capacity=10))[:2] == (0.3, 10)
    inputs = pool(2, 6, capacity=10)
    assert (inputs.ready, inputs.in_flight, inputs.capacity) == (2, 8, 20)
    assert inputs.utilization == pytest.approx(0.4)


def test_an_engine_queue_means_the_replica_is_saturated_at_its_batch() -> None:
    # 8 running in the engine's batch, 12 more queued: 20 requests for a batch of 8 = 2.5.
    r = replica(20, queued=12, capacity=64, engine={"batch_size": 8.0, "step_ms": 50.0})
    util, cap, kv, latency = replica_figures(r)
    assert util == pytest.approx(2.5)
    assert cap == 64 and kv is None
    assert latency == pytest.approx(50.0 * (1 + 12 / 8))  # 1.5 batches ahead + its own step


def test_vllm_fields_are_read_when_present() -> None:
    engine = {"running": 6.0, "waiting": 10.0, "max_num_seqs": 8.0, "kv_cache_usage": 0.3}
    util, cap, kv, _ = replica_figures(replica(1, capacity=64, engine=engine))
    assert cap == 8  # the engine's batch limit, not the sidecar's admission limit
    assert util == pytest.approx(16 / 6)  # 16 requests for the 6 its KV cache lets run
    engine = {"running": 2.0, "waiting": 0.0, "max_num_seqs": 8.0}
    assert replica_figures(replica(2, capacity=64, engine=engine))[0] == pytest.approx(2 / 8)
    assert kv == pytest.approx(0.3)
    # KV-cache use is a floor: a nearly idle replica whose cache is 90% full is 90% used.
    util, _, kv, _ = replica_figures(replica(1, engine={"kv_cache_usage": 90.0}))  # percent
    assert kv == pytest.approx(0.9) and util == pytest.approx(0.9)
    inputs = stage_inputs([replica(1, engine={"kv_cache_usage": 0.2}), replica(1, n=1)])
    assert inputs.kv_cache_usage == pytest.approx(0.2)


def test_hops_waiting_on_later_stages_are_not_load() -> None:
    # 30 requests in flight through this pod, but its engine is idle: they wait downstream.
    engine = {"running": 0.0, "batch_size": 4.0, "step_ms": 5.0}
    waiting_downstream = replica(30, capacity=64, engine=engine)
    assert replica_figures(waiting_downstream)[0] == 0.0
    inputs = stage_inputs([waiting_downstream])
    assert inputs.in_flight == 30
    assert recommend(policy(), inputs) == (0, "idle")


def test_without_an_engine_count_a_stale_batch_size_is_not_load() -> None:
    # The last step's batch_size stays reported while the engine idles: only a queue counts.
    idle = replica(0, capacity=64, engine={"batch_size": 8.0, "step_ms": 50.0})
    assert replica_figures(idle)[0] == 0.0
    assert recommend(policy(), stage_inputs([idle])) == (0, "idle")


def test_a_reported_latency_wins_over_the_estimate() -> None:
    r = replica(4, queued=4, engine={"batch_size": 4.0, "step_ms": 10.0, "latency_ms": 300.0})
    assert replica_figures(r)[3] == 300.0
    assert stage_inputs([r]).step_ms == 10.0


def test_a_reported_occupancy_is_the_demand_not_the_instants_counts() -> None:
    # One request running at the instant of the heartbeat, in flight 5% of the interval.
    caught = {"running": 1.0, "waiting": 0.0, "max_num_seqs": 1.0, ENGINE_OCCUPANCY: 0.05}
    assert replica_figures(replica(1, capacity=4, engine=caught))[0] == pytest.approx(0.05)
    # A queue is in the average already (an engine fills its batch before it queues): no
    # saturation floor on top, which would count the queue twice.
    queueing = {"running": 4.0, "max_num_seqs": 4.0, "batch_size": 4.0, ENGINE_OCCUPANCY: 6.0}
    r = replica(6, queued=2, capacity=8, engine=queueing)
    assert replica_figures(r)[0] == pytest.approx(1.5)
    # KV-cache use stays a floor; an idle interval is idle whatever the instant said.
    kv = {"running": 1.0, "max_num_seqs": 8.0, "kv_cache_usage": 0.9, ENGINE_OCCUPANCY: 0.1}
    assert replica_figures(replica(1, engine=kv))[0] == pytest.approx(0.9)
    idle = {"running": 1.0, "max_num_seqs": 1.0, ENGINE_OCCUPANCY: 0.0}
    assert recommend(policy(), stage_inputs([replica(1, engine=idle)])) == (0, "idle")


def test_a_rolling_upgrade_mixes_averaged_and_instant_reports() -> None:
    # A replica that predates the average reports its instant's counts and is read as before;
    # the stage's utilization is the mean of each replica's own.
    old = replica(1, capacity=4, engine={"running": 1.0, "max_num_seqs": 1.0})
    new = replica(1, capacity=4, engine={"running": 1.0, "max_num_seqs": 1.0,
                                         ENGINE_OCCUPANCY: 0.05}, n=1)  # fmt: skip
    assert replica_figures(old)[0] == 1.0
    assert stage_inputs([old, new]).utilization == pytest.approx((1.0 + 0.05) / 2)


# ---- recommendation -------------------------------------------------------------------------


def test_recommendation_follows_the_hpa_rule() -> None:
    p = policy(target_utilization=0.5, tolerance=0.1)
    assert recommend(p, loaded(2, 1.0)) == (4, "utilization")  # 2 x 1.0 / 0.5
    assert recommend(p, loaded(4, 0.2)) == (2, "utilization")  # ceil(4 x 0.4) = 2
    assert recommend(p, loaded(3, 0.5)) == (3, "within_tolerance")
    assert recommend(p, pool(5, 5, 5, 6)) == (4, "within_tolerance")  # 0.525 / 0.5 = 1.05
    assert recommend(p, loaded(3, 0.0)) == (0, "idle")
    assert recommend(p, ScaleInputs()) == (0, "idle")


def test_latency_target_asks_for_more_when_queues_grow() -> None:
    r = replica(5, queued=5, capacity=100, engine={"batch_size": 5.0, "step_ms": 100.0})
    inputs = stage_inputs([r])  # utilization (5 + 5) / 5 = 2: 4 replicas by utilization
    assert recommend(policy(target_utilization=0.5), inputs) == (4, "utilization")
    slow = policy(target_utilization=0.5, target_latency_ms=40.0)  # 200 ms estimated: 5x
    assert recommend(slow, inputs) == (5, "latency")
    assert recommend(policy(target_latency_ms=1000.0), inputs)[1] == "utilization"


def test_a_queue_wait_target_asks_for_more_when_the_reported_wait_passes_it() -> None:
    # One request at a time, the admission queue behind it (max_inflight 1): the engine is at
    # its capacity, utilization 1.0, within the target's tolerance, whatever waits.
    def waited(ms: float, n: int = 0) -> InstanceInfo:
        engine = {"running": 1.0, "max_num_seqs": 1.0, ENGINE_OCCUPANCY: 1.0,
                  ENGINE_QUEUE_WAIT_MS: ms}  # fmt: skip
        return replica(3, capacity=1, engine=engine, n=n)

    p = policy(target_utilization=1.0, target_queue_wait_ms=100.0)
    assert recommend(policy(target_utilization=1.0), stage_inputs([waited(300.0)])) == (
        1,
        "within_tolerance",
    )
    assert recommend(p, stage_inputs([waited(300.0)])) == (3, "queue_wait")  # ceil(1 x 3)
    inputs = stage_inputs([waited(300.0), waited(50.0, n=1)])
    assert inputs.queue_wait_ms == pytest.approx(175.0)  # the mean over the replicas
    assert recommend(p, inputs) == (4, "queue_wait")  # ceil(2 x 1.75)
    assert recommend(p, stage_inputs([waited(80.0)])) == (1, "within_tolerance")  # met
    # A replica that does not report it is not counted in the mean; none: no figure.
    old = replica(1, capacity=1, engine={"running": 1.0, "max_num_seqs": 1.0}, n=2)
    assert stage_inputs([waited(300.0), old]).queue_wait_ms == 300.0
    assert stage_inputs([old]).queue_wait_ms is None
    # Requests that waited are load: not idle, even on an interval whose occupancy says 0 (its
    # slots held by hops that wait on later stages, say); with no wait and no work, idle.
    stuck = {"running": 0.0, ENGINE_OCCUPANCY: 0.0, ENGINE_QUEUE_WAIT_MS: 500.0}
    assert recommend(p, stage_inputs([replica(4, engine=stuck)])) == (5, "queue_wait")
    assert recommend(policy(), stage_inputs([replica(4, engine=stuck)])) == (1, "utilization")
    idle = {"running": 0.0, ENGINE_OCCUPANCY: 0.0, ENGINE_QUEUE_WAIT_MS: 0.0}
    assert recommend(p, stage_inputs([replica(0, engine=idle)])) == (0, "idle")


def first_audio(counts: Mapping[float, int], above: int = 0) -> dict[str, float]:
    """An API server's reported window: ``counts`` answers per bucket bound (not cumulative)
    and ``above`` past the last bound."""
    figures, running = {}, 0
    for bound, count in sorted(counts.items()):
        running += count
        figures[f"first_audio_le_{bound:g}"] = float(running)
    figures["first_audio_count"] = float(running + above)
    return figures


def test_the_first_audio_p95_merges_the_api_servers_windows() -> None:
    # Two API servers: 30 answers within 0.2 s on one, 10 between 0.5 and 1 s on the other. The
    # p95 of the 40 (rank 38) lies in (0.5, 1.0], 8 of its 10: 0.9 s.
    one = replica(engine=first_audio({0.1: 10, 0.2: 20, 0.5: 0, 1.0: 0}), n=0)
    two = replica(engine=first_audio({0.1: 0, 0.2: 0, 0.5: 0, 1.0: 10}), n=1)
    p95_ms, samples = first_audio_p95([one, two])
    assert samples == 40 and p95_ms == pytest.approx(900.0)
    # Alone, the first one's p95 is in (0.1, 0.2].
    assert first_audio_p95([one])[0] == pytest.approx(100.0 + 100.0 * (28.5 - 10) / 20)
    # Too few answers: no figure (one slow answer of a handful is not a p95).
    few = replica(engine=first_audio({1.0: MIN_SAMPLES - 1}), n=2)
    assert first_audio_p95([few]) == (None, MIN_SAMPLES - 1)
    # A server that reports none (no answer lately, or an older release) adds nothing, and
    # figures that are not bounds are ignored.
    old = replica(engine={"running": 1.0}, n=3)
    odd = replica(engine={**first_audio({0.1: 25}), "first_audio_le_x": 3.0}, n=4)
    assert first_audio_p95([old]) == (None, 0)
    assert first_audio_p95([old, odd]) == (pytest.approx(95.0), 25)
    # Past the last bound: the last bound.
    slow = replica(engine=first_audio({30.0: 0}, above=30), n=5)
    assert first_audio_p95([slow]) == (30_000.0, 30)


def test_a_first_audio_target_asks_for_more_when_the_p95_passes_it() -> None:
    busy = {"running": 1.0, "max_num_seqs": 1.0, ENGINE_OCCUPANCY: 1.0}
    inputs = stage_inputs([replica(2, capacity=1, engine=busy)])
    assert inputs.first_audio_p95_ms is None  # read by the autoscaler, for pools that target it
    p = policy(target_utilization=1.0, target_first_audio_p95_ms=250.0)
    assert recommend(p, inputs) == (1, "within_tolerance")  # no figure: utilization decides
    late = inputs.model_copy(update={"first_audio_p95_ms": 600.0, "first_audio_samples": 40})
    assert recommend(p, late) == (3, "first_audio")  # ceil(1 x 600 / 250)
    assert recommend(policy(target_utilization=1.0), late) == (1, "within_tolerance")
    met = inputs.model_copy(update={"first_audio_p95_ms": 200.0})
    assert recommend(p, met) == (1, "within_tolerance")
    # The windows outlive the load by a few seconds: a stage with no work left is idle.
    idle = stage_inputs([replica(0, engine={"running": 0.0, ENGINE_OCCUPANCY: 0.0})])
    assert recommend(p, idle.model_copy(update={"first_audio_p95_ms": 600.0})) == (0, "idle")


def test_a_realtime_factor_target_is_a_floor_on_the_low_quantile() -> None:
    # 40 answers: 2 made at 0.4-0.5x real time, 38 at 2-3x. The p5 (rank 2) is 0.5.
    window = {"rtf_le_0.25": 0.0, "rtf_le_0.5": 2.0, "rtf_le_2": 2.0, "rtf_le_3": 40.0,
              "rtf_count": 40.0}  # fmt: skip
    assert realtime_factor_p5([replica(engine=window)]) == (pytest.approx(0.5), 40)
    assert realtime_factor_p5([replica(engine={"rtf_count": 5.0, "rtf_le_3": 5.0})])[0] is None
    busy = {"running": 1.0, "max_num_seqs": 1.0, ENGINE_OCCUPANCY: 1.0}
    inputs = stage_inputs([replica(2, capacity=1, engine=busy)])
    p = policy(target_utilization=1.0, target_realtime_factor_p5=1.2)
    behind = inputs.model_copy(update={"realtime_factor_p5": 0.5})
    assert recommend(p, behind) == (3, "realtime_factor")  # ceil(1 x 1.2 / 0.5)
    ahead = inputs.model_copy(update={"realtime_factor_p5": 2.0})
    assert recommend(p, ahead) == (1, "within_tolerance")  # above the floor: met
    assert recommend(p, inputs) == (1, "within_tolerance")  # no figure
    assert recommend(p, inputs.model_copy(update={"realtime_factor_p5": 0.0}))[0] == 1200


def test_waiting_requests_wake_a_stage_at_zero() -> None:
    p = policy(min_replicas=0)
    assert recommend(p, ScaleInputs(wake_waiting=1)) == (1, "wake")
    assert recommend(p, ScaleInputs(wake_waiting=3)) == (3, "wake")  # capacity unknown: 1 each


# ---- hysteresis -----------------------------------------------------------------------------


def test_scale_up_waits_for_the_load_to_last_the_scale_up_window() -> None:
    p = policy(scale_up_window_s=3.0)
    start = initial_decision(p, loaded(1, 0.5), T0, replicas=1)
    decisions = run(p, start, [loaded(1, 1.0)] * 5)  # twice the target from t=1 s
    assert [d.desired for d in decisions] == [1, 1, 1, 2, 2]
    assert decisions[0].reason == "scale_up_window"
    assert decisions[3].direction is ScaleDirection.UP and decisions[3].reason == "utilization"
    # A blip shorter than the window changes nothing.
    blip = run(p, start, [loaded(1, 1.0), loaded(1, 0.5), loaded(1, 1.0), loaded(1, 0.5)] * 3)
    assert {d.desired for d in blip} == {1}


def test_scale_down_waits_for_the_scale_down_window_and_steps_one_at_a_time() -> None:
    p = policy(scale_down_window_s=10.0, max_scale_down_step=1)
    start = initial_decision(p, loaded(4, 0.5), T0, replicas=4)
    decisions = run(p, start, [loaded(4, 0.1)] * 14)  # asks for 1 replica from t=1 s
    desired = [d.desired for d in decisions]
    assert desired[:10] == [4] * 10
    assert desired[10:14] == [3, 2, 1, 1]
    assert decisions[10].direction is ScaleDirection.DOWN


def test_after_the_load_stops_the_pool_steps_down_once_per_cooldown_not_per_window() -> None:
    """Kubernetes HPA's stabilization with the default knobs (60 s window, 5 s cooldown, one
    replica per step): three idle vLLM replicas (their engines' own figures: nothing running
    or waiting, an empty KV cache, the last step's time still reported) go to 2 once the
    window has seen only lower recommendations, and to 1 a cooldown later."""
    p = AutoscaleConfig(min_replicas=1, max_replicas=4)
    assert (p.scale_down_window_s, p.cooldown_s, p.max_scale_down_step) == (60.0, 5.0, 1)
    idle = {"running": 0.0, "waiting": 0.0, "max_num_seqs": 8.0, "kv_cache_usage": 0.0,
            "step_ms": 40.0, "batch_size": 8.0}  # fmt: skip
    d = initial_decision(p, ScaleInputs(), T0, replicas=3)
    changes: list[tuple[float, int]] = []
    for k in range(1, 4 * 90):  # a decision per sweep (250 ms) for 90 s after the load
        now = T0 + k * 250
        ready = [replica(0, capacity=64, engine=idle, n=i) for i in range(d.desired)]
        d = decide(p, stage_inputs(ready), d, now)
        if d.direction is ScaleDirection.DOWN:
            changes.append(((now - T0) / 1000, d.desired))
    assert changes == [(60.25, 2), (65.25, 1)]


def trickle_decisions(
    p: AutoscaleConfig, start: int, seconds: int, *, averaged: bool
) -> list[tuple[float, int]]:
    """The desired count each second for ``seconds`` of a trickle (issue 35, item 3): one 40 ms
    request a second on a pool of ``max_num_seqs: 1`` replicas, each replica heartbeating every
    second. Averaged, the replica that served the second's request reports an occupancy of
    0.04; read at one instant, it reports it running when the heartbeat caught it, here at
    seconds 20, 50, 80 and 110 (about once in 25 heartbeats, 40 ms of every 1000)."""
    d = initial_decision(p, ScaleInputs(), T0, replicas=start)
    out: list[tuple[float, int]] = []
    for k in range(1, seconds + 1):
        caught = k % 30 == 20
        ready = []
        for i in range(d.desired):
            served = i == k % d.desired
            engine = {"running": float(served and caught), "waiting": 0.0, "max_num_seqs": 1.0}
            if averaged:
                engine[ENGINE_OCCUPANCY] = 0.04 if served else 0.0
            ready.append(replica(0, capacity=4, engine=engine, n=i))
        d = decide(p, stage_inputs(ready), d, T0 + k * 1000)
        out.append((k, d.desired))
    return out


def test_a_trickle_comes_back_to_min_replicas_from_its_averaged_load() -> None:
    p = AutoscaleConfig(min_replicas=1, max_replicas=4)  # 60 s down, 5 s cooldown, 1 a step
    # After a load left 3 replicas (the trickle's first decision at 1 s): 2 once the window has
    # seen only its recommendation for 60 s, 1 a cooldown later, and it stays there.
    after_load = trickle_decisions(p, 3, 130, averaged=True)
    steps = itertools.pairwise([(0, 3), *after_load])
    assert [(t, n) for (_, was), (t, n) in steps if n != was] == [(61, 2), (66, 1)]
    # Read at one instant, every catch asks for 2 and holds the 60 s window: never back to 1.
    sampled = trickle_decisions(p, 3, 130, averaged=False)
    assert min(n for _, n in sampled) == 2
    # With no scale-up window, a pool at its minimum stays there; sampled, a catch adds one.
    eager = policy(min_replicas=1, max_replicas=3, target_utilization=0.6, scale_up_window_s=0)
    assert {n for _, n in trickle_decisions(eager, 1, 60, averaged=True)} == {1}
    assert max(n for _, n in trickle_decisions(eager, 1, 60, averaged=False)) == 2


def test_step_limits_and_max() -> None:
    p = policy(max_replicas=5, max_scale_up_step=2, scale_up_window_s=0.0)
    start = initial_decision(p, loaded(1, 0.5), T0, replicas=1)
    decisions = run(p, start, [loaded(1, 5.0)] * 4)  # asks for 10
    assert [d.desired for d in decisions] == [3, 5, 5, 5]
    assert decisions[0].recommended == 5  # clamped to max_replicas


def test_cooldown_spaces_changes() -> None:
    p = policy(cooldown_s=3.0, scale_up_window_s=0.0, max_scale_up_step=1)
    start = initial_decision(p, loaded(1, 0.5), T0 - 10_000, replicas=1)
    start = start.model_copy(update={"decided_at_ms": T0})
    decisions = run(p, start, [loaded(1, 4.0)] * 7)
    assert [d.desired for d in decisions] == [2, 2, 2, 3, 3, 3, 4]
    assert decisions[1].reason == "cooldown"


def test_min_replicas_holds_an_idle_stage() -> None:
    p = policy(min_replicas=2, scale_down_window_s=0.0)
    decisions = run(p, initial_decision(p, loaded(3, 0.5), T0, 3), [loaded(3, 0.0)] * 4)
    assert [d.desired for d in decisions] == [2, 2, 2, 2]
    assert decisions[-1].reason == "idle"


def test_idle_stage_scales_to_zero_and_a_waiting_request_wakes_it_at_once() -> None:
    p = policy(min_replicas=0, scale_down_window_s=5.0, scale_up_window_s=30.0, cooldown_s=60.0)
    start = initial_decision(p, loaded(1, 0.5), T0 - 120_000, 1).model_copy(
        update={"decided_at_ms": T0}
    )
    idle = run(p, start, [loaded(1, 0.0)] * 6)
    assert [d.desired for d in idle] == [1, 1, 1, 1, 1, 0]
    assert idle[-1].reason == "idle"
    stays = decide(p, ScaleInputs(), idle[-1], T0 + 60_000)
    assert stays.desired == 0 and stays.direction is ScaleDirection.HOLD
    # No replica, a request waits: one replica at once, despite the window and the cooldown.
    woken = decide(p, ScaleInputs(wake_waiting=1), stays, T0 + 61_000)
    assert (woken.desired, woken.direction, woken.reason) == (1, ScaleDirection.UP, "wake")


def test_changed_bounds_apply_at_once() -> None:
    p = policy(max_replicas=8)
    d = initial_decision(p, loaded(6, 0.5), T0, 6)
    narrowed = decide(policy(max_replicas=4), loaded(6, 0.5), d, T0 + 1000)
    assert (narrowed.desired, narrowed.reason) == (4, "bounds")


def test_no_flapping_under_noisy_load() -> None:
    """Load jitters +-40% around the target for ten minutes: the desired count never moves."""
    p = AutoscaleConfig(min_replicas=1, max_replicas=10, target_utilization=0.6)  # defaults
    rng = random.Random(7)
    d = initial_decision(p, loaded(3, 0.6), T0, 3)
    changes = 0
    for k in range(1, 1200):  # a decision every 500 ms
        per = [max(0, round(10 * 0.6 * rng.uniform(0.6, 1.4))) for _ in range(3)]
        d2 = decide(p, pool(*per), d, T0 + k * 500)
        changes += d2.desired != d.desired
        d = d2
    assert changes == 0
    assert len(d.history) <= MAX_HISTORY


def test_a_step_and_a_square_wave_are_followed_both_ways() -> None:
    p = policy(scale_up_window_s=2.0, scale_down_window_s=10.0, cooldown_s=0.0, max_replicas=6)
    d = initial_decision(p, loaded(1, 0.5), T0, 1)
    desired: list[int] = []
    total_demand = 0
    for k in range(1, 121):
        total_demand = 25 if (k // 30) % 2 == 0 else 2  # 25 requests, then 2, every 30 s
        n = d.desired  # the actuator follows at once
        per = [total_demand // n + (1 if i < total_demand % n else 0) for i in range(n)]
        d = decide(p, pool(*per, capacity=10), d, T0 + k * 1000)
        desired.append(d.desired)
    assert max(desired[:30]) == 5  # 25 / (10 x 0.5)
    assert desired[29] == 5
    assert desired[59] == 1  # scaled down within the low half-period
    assert desired[89] == 5  # and up again
    swings = sum(1 for a, b in itertools.pairwise(desired) if a != b)
    assert swings <= 12  # up once per high half, down step by step per low half


def test_history_is_pruned_to_the_windows() -> None:
    p = policy(scale_up_window_s=1.0, scale_down_window_s=2.0)
    d = initial_decision(p, loaded(2, 0.5), T0, 2)
    for k in range(1, 50):
        d = decide(p, loaded(2, 0.5 if k % 2 else 1.0), d, T0 + k * 1000)
    assert len(d.history) <= 4
    assert d.history[-1][0] == T0 + 49_000


def test_unknown_previous_decision_starts_from_the_ready_count() -> None:
    d = decide(policy(), loaded(3, 0.5), None, T0)
    assert d.previous == 3 and d.desired == 3


def test_module_has_no_io() -> None:
    source = policy_mod.__loader__.get_source(policy_mod.__name__)  # type: ignore[union-attr]
    assert source is not None
    for word in ("redis", "aiohttp", "asyncio", "time.time", "logging"):
        assert word not in source, word


# ---- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "field", "words"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, "autoscale", "must be at least min_replicas"),
        ({"target_utilization": 0}, "autoscale.target_utilization", "greater than 0"),
        ({"target_utilization": 1.5}, "autoscale.target_utilization", "less than or equal"),
        ({"min_replicas": -1}, "autoscale.min_replicas", "greater than or equal"),
        ({"scale_up_window_s": -1}, "autoscale.scale_up_window_s", "greater than or equal"),
        ({"max_scale_down_step": 0}, "autoscale.max_scale_down_step", "greater than or equal"),
        ({"target_latency_ms": 0}, "autoscale.target_latency_ms", "greater than 0"),
        (
            {"target_first_audio_p95_ms": -5},
            "autoscale.target_first_audio_p95_ms",
            "greater than 0",
        ),
        (
            {"target_realtime_factor_p5": 0},
            "autoscale.target_realtime_factor_p5",
            "greater than or equal",
        ),
        (
            {"target_first_audio_p95_ms": 120_000},
            "autoscale.target_first_audio_p95_ms",
            "less than or equal",
        ),
        ({"bogus": 1}, "autoscale.bogus", "Extra inputs"),
    ],
)
def test_bad_autoscale_sections_name_the_field(
    given: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(ValidationError) as info:
        StageDeployConfig.model_validate({"stage_id": 1, "autoscale": given})
    error = info.value.errors()[0]
    assert ".".join(str(p) for p in error["loc"]) == field
    assert words in error["msg"]


def test_num_replicas_is_the_starting_count_within_bounds() -> None:
    ok = StageDeployConfig.model_validate(
        {"stage_id": 1, "num_replicas": 2, "autoscale": {"min_replicas": 0, "max_replicas": 3}}
    )
    assert ok.max_pool_size == 3 and ok.num_replicas == 2
    assert ok.replica_devices(2) == ()  # replicas up to max_replicas may start
    with pytest.raises(ValidationError, match=r"num_replicas \(5\).*\[0, 3\]"):
        StageDeployConfig.model_validate(
            {"stage_id": 1, "num_replicas": 5, "autoscale": {"min_replicas": 0, "max_replicas": 3}}
        )
    with pytest.raises(ValidationError, match=r"num_replicas \(1\).*\[2, 4\]"):
        StageDeployConfig.model_validate(
            {"stage_id": 1, "autoscale": {"min_replicas": 2, "max_replicas": 4}}
        )


def test_devices_must_cover_the_largest_pool() -> None:
    from omni_mesh.configs.deploy import DeployConfig

    ok = {"stage_id": 0, "devices": "0,1,2", "autoscale": {"max_replicas": 3}}
    assert DeployConfig.model_validate({"stages": [ok]}).stage(0).max_pool_size == 3
    bad = {"stage_id": 0, "devices": "0", "autoscale": {"max_replicas": 3}}
    with pytest.raises(ValidationError, match=r"x autoscale\.max_replicas 3"):
        DeployConfig.model_validate({"stages": [bad]})


def test_yaml_autoscale_merges_and_bad_values_name_the_stage_field(tmp_path: Path) -> None:
    spec = get_pipeline("synthetic")
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "stages:\n"
        "  - stage_id: 1\n"
        "    num_replicas: 2\n"
        "    autoscale: {min_replicas: 0, max_replicas: 3, target_utilization: 0.7}\n"
    )
    cfg = load_deploy_config(path, spec, stage_overrides={"1": {"autoscale": {"max_replicas": 5}}})
    scale = cfg.stage(1).autoscale
    assert scale is not None
    assert (scale.min_replicas, scale.max_replicas, scale.target_utilization) == (0, 5, 0.7)
    assert cfg.stage(0).autoscale is None
    path.write_text("stages:\n  - stage_id: 1\n    autoscale: {target_utilization: 1.5}\n")
    with pytest.raises(DeployConfigError, match=r"autoscale\.target_utilization") as info:
        load_deploy_config(path, spec)
    assert "stage" in str(info.value) and "1" in str(info.value)
