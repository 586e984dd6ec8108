"""The per-stage autoscaling policy: pure functions, no IO (the loop around it is
``autoscaler.py``).

1. **Inputs** (:func:`stage_inputs`): each ready replica's utilization is its demand over its
   capacity. Where the heartbeat's engine figures (``LoadReport.engine``) carry ``occupancy``
   (:data:`~omni_mesh.control_plane.schema.ENGINE_OCCUPANCY`), demand is that: the engine's
   own work, its queue included, averaged over the time since the replica's previous
   heartbeat. Otherwise (a replica that predates it) demand is read at one instant: where the
   engine figures count the engine's own work (``running``, plus a model engine's own
   ``waiting``) it is ``running + waiting + queued`` (a sidecar's in-flight count also holds
   hops that wait on later stages, which are not this stage's load), without ``running`` it is
   ``in_flight``; and a replica whose work queues is saturated at its batch (``running``, else
   the last step's ``batch_size``): its utilization is at least ``(batch + queued) / batch``.
   (Averaged, a queue is in the occupancy already: an engine takes up to ``max_num_seqs``
   before it queues.) Capacity is the engine's ``max_num_seqs`` where reported, else the
   replica's capacity. A reported ``kv_cache_usage`` (0..1) is a floor too. The stage's
   utilization is the mean over its ready replicas.
2. **Recommendation** (:func:`recommend`): ``ceil(sum of utilizations / target)`` replicas
   (Kubernetes HPA's rule), unchanged while the mean is within ``target x (1 +- tolerance)``;
   0 when nothing ran, queued or waited (idle); more when the estimated queue + step time
   exceeds ``target_latency_ms``, or the replicas' reported queue wait (mean over them)
   exceeds ``target_queue_wait_ms``, or the pipeline's first-audio p95 (its API servers',
   ``audio_slo.py``) exceeds ``target_first_audio_p95_ms``: ``ceil(ready x figure / target)``
   where that is more; a real-time factor's p5 below ``target_realtime_factor_p5`` likewise asks
   for ``ceil(ready x target / figure)``; at least enough for the waiting requests of a stage at
   zero.
3. **Hysteresis** (:func:`decide`): the desired count rises only to what every recommendation
   of the last ``scale_up_window_s`` asked for (sustained load), falls only to the highest
   recommendation of the last ``scale_down_window_s``, by at most ``max_scale_up_step`` /
   ``max_scale_down_step`` per decision and not sooner than ``cooldown_s`` after the last
   change. A stage at zero with requests waiting skips windows and cooldown (a cold start must
   not wait longer than it has to). Everything ends within ``[min_replicas, max_replicas]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.schema import (
    ENGINE_OCCUPANCY,
    ENGINE_QUEUE_WAIT_MS,
    InstanceInfo,
    ScaleDecision,
    ScaleDirection,
    ScaleInputs,
)

#: Most (time, recommendation) change points kept in a decision's history.
MAX_HISTORY = 256

REASON_INITIAL = "initial"
REASON_UTILIZATION = "utilization"
REASON_TOLERANCE = "within_tolerance"
REASON_LATENCY = "latency"
REASON_QUEUE_WAIT = "queue_wait"
REASON_FIRST_AUDIO = "first_audio"
REASON_REALTIME_FACTOR = "realtime_factor"
REASON_WAKE = "wake"
REASON_IDLE = "idle"
REASON_BOUNDS = "bounds"
REASON_COOLDOWN = "cooldown"
REASON_UP_WINDOW = "scale_up_window"
REASON_DOWN_WINDOW = "scale_down_window"


# ---- 1. inputs ------------------------------------------------------------------------------


def _engine_value(engine: Mapping[str, float], *names: str) -> float | None:
    for name in names:
        value = engine.get(name)
        if value is not None and value >= 0:
            return float(value)
    return None


def replica_figures(info: InstanceInfo) -> tuple[float, int, float | None, float | None]:
    """(utilization, capacity, kv_cache_usage, estimated latency ms) of one replica."""
    load, engine = info.load, info.load.engine
    capacity = int(_engine_value(engine, "max_num_seqs") or load.capacity or info.capacity or 1)
    running = _engine_value(engine, "running")
    waiting = _engine_value(engine, "waiting") or 0.0
    if running is None:  # no count of the engine's own work: the sidecar's in-flight count
        demand = float(load.in_flight)
        batch = _engine_value(engine, "batch_size")  # the last step's: current while queueing
        queueing = load.queued
    else:  # the engine's own work: a hop waiting on later stages is not this stage's load
        demand = running + waiting + load.queued
        batch, queueing = running, int(waiting) + load.queued
    occupancy = _engine_value(engine, ENGINE_OCCUPANCY)
    if occupancy is not None:  # the same work averaged since the last heartbeat, queue included
        utilization = occupancy / max(1, capacity)
    else:  # a replica that reports only this instant's counts (a sidecar before the average)
        utilization = demand / max(1, capacity)
        if queueing > 0 and batch is not None and batch >= 1:
            utilization = max(utilization, (batch + queueing) / batch)  # saturated at its batch
    kv = _engine_value(engine, "kv_cache_usage", "gpu_cache_usage")
    if kv is not None:
        kv = kv / 100.0 if kv > 1.0 else kv  # some engines report a percentage
        utilization = max(utilization, kv)
    latency = _engine_value(engine, "latency_ms")
    step_ms = _engine_value(engine, "step_ms")
    if latency is None and step_ms:
        batches_ahead = queueing / batch if batch is not None and batch >= 1 else 0.0
        latency = step_ms * (1.0 + batches_ahead)
    return utilization, capacity, kv, latency


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def stage_inputs(ready: Sequence[InstanceInfo], wake_waiting: int = 0) -> ScaleInputs:
    """The figures the policy decides from, given the stage's healthy replicas."""
    figures = [replica_figures(i) for i in ready]
    kvs = [f[2] for f in figures if f[2] is not None]
    latencies = [f[3] for f in figures if f[3] is not None]
    steps = [float(i.load.engine["step_ms"]) for i in ready if "step_ms" in i.load.engine]
    waits = [
        w for i in ready if (w := _engine_value(i.load.engine, ENGINE_QUEUE_WAIT_MS)) is not None
    ]
    return ScaleInputs(
        ready=len(ready),
        in_flight=sum(i.load.in_flight for i in ready),
        queued=sum(i.load.queued for i in ready),
        capacity=sum(f[1] for f in figures),
        utilization=_mean([f[0] for f in figures]) or 0.0,
        step_ms=_mean(steps),
        kv_cache_usage=max(kvs) if kvs else None,
        latency_ms=_mean(latencies),
        queue_wait_ms=_mean(waits),
        wake_waiting=wake_waiting,
    )


# ---- 2. recommendation ----------------------------------------------------------------------


def recommend(policy: AutoscaleConfig, inputs: ScaleInputs) -> tuple[int, str]:
    """Replicas the load asks for (before min/max) and the signal that decided it."""
    target = policy.target_utilization
    if inputs.ready == 0:
        if inputs.wake_waiting <= 0:
            return 0, REASON_IDLE
        per_replica = max(1.0, target * (inputs.capacity or 1))
        return max(1, math.ceil(inputs.wake_waiting / per_replica)), REASON_WAKE
    if inputs.queued == 0 and inputs.utilization <= 0.0 and not inputs.queue_wait_ms:
        return 0, REASON_IDLE
    ratio = inputs.utilization / target
    if abs(ratio - 1.0) <= policy.tolerance:
        replicas, reason = inputs.ready, REASON_TOLERANCE
    else:
        replicas, reason = max(1, math.ceil(inputs.ready * ratio - 1e-9)), REASON_UTILIZATION
    for goal, value, why in (
        (policy.target_latency_ms, inputs.latency_ms, REASON_LATENCY),
        (policy.target_queue_wait_ms, inputs.queue_wait_ms, REASON_QUEUE_WAIT),
        (policy.target_first_audio_p95_ms, inputs.first_audio_p95_ms, REASON_FIRST_AUDIO),
    ):
        if goal is not None and value is not None and value > goal:
            by_goal = math.ceil(inputs.ready * value / goal - 1e-9)
            if by_goal > replicas:
                replicas, reason = by_goal, why
    floor, rtf = policy.target_realtime_factor_p5, inputs.realtime_factor_p5
    if floor is not None and rtf is not None and rtf < floor:  # a floor: lower is worse
        by_rtf = math.ceil(inputs.ready * floor / max(rtf, 1e-3) - 1e-9)
        if by_rtf > replicas:
            replicas, reason = by_rtf, REASON_REALTIME_FACTOR
    return replicas, reason


# ---- 3. hysteresis --------------------------------------------------------------------------


def _history(
    previous: Sequence[tuple[int, int]], now_ms: int, value: int, keep_ms: int
) -> tuple[tuple[int, int], ...]:
    """Change points of the recommendation with ``value`` appended (if it changed), pruned to
    the points still inside the longest window (the last one always stays)."""
    points = list(previous)
    if not points or points[-1][1] != value:
        points.append((now_ms, value))
    horizon = now_ms - keep_ms
    start = 0
    while start + 1 < len(points) and points[start + 1][0] <= horizon:
        start += 1
    return tuple(points[max(start, len(points) - MAX_HISTORY) :])


def _window(points: Sequence[tuple[int, int]], now_ms: int, window_ms: int) -> list[int]:
    """Recommendations in force at some time within the last ``window_ms``."""
    horizon = now_ms - window_ms
    out: list[int] = []
    for k, (_, value) in enumerate(points):
        ends = points[k + 1][0] if k + 1 < len(points) else now_ms + 1
        if ends > horizon:
            out.append(value)
    return out


def initial_decision(
    policy: AutoscaleConfig, inputs: ScaleInputs, now_ms: int, replicas: int | None = None
) -> ScaleDecision:
    """The decision a newly known policy starts from: ``replicas`` (else the ready count)."""
    start = policy.clamp(inputs.ready if replicas is None else replicas)
    return ScaleDecision(
        desired=start,
        previous=start,
        recommended=start,
        direction=ScaleDirection.HOLD,
        reason=REASON_INITIAL,
        decided_at_ms=now_ms,
        changed_at_ms=now_ms,
        inputs=inputs,
        history=((now_ms, start),),
    )


def decide(
    policy: AutoscaleConfig,
    inputs: ScaleInputs,
    previous: ScaleDecision | None,
    now_ms: int,
) -> ScaleDecision:
    """The next decision for a stage, from its policy, its load and the last decision."""
    if previous is None:
        previous = initial_decision(policy, inputs, now_ms)
    raw, why = recommend(policy, inputs)
    rec = policy.clamp(raw)
    keep_ms = int(1000 * max(policy.scale_up_window_s, policy.scale_down_window_s))
    history = _history(previous.history, now_ms, rec, keep_ms)
    base = previous.desired
    target, reason = _stabilized(policy, history, now_ms, base, rec, why)
    bounded = policy.clamp(base)
    if bounded != base:  # the policy's bounds changed under the current count
        target, reason = bounded, REASON_BOUNDS
    elif base == 0 and why == REASON_WAKE:  # a cold start skips windows and cooldown
        target, reason = rec, REASON_WAKE
    elif target != base and now_ms - previous.changed_at_ms < policy.cooldown_s * 1000:
        target, reason = base, REASON_COOLDOWN
    target = max(base - policy.max_scale_down_step, min(base + policy.max_scale_up_step, target))
    target = policy.clamp(target)
    direction = (
        ScaleDirection.UP
        if target > base
        else ScaleDirection.DOWN
        if target < base
        else ScaleDirection.HOLD
    )
    return ScaleDecision(
        desired=target,
        previous=base,
        recommended=rec,
        direction=direction,
        reason=reason,
        decided_at_ms=now_ms,
        changed_at_ms=previous.changed_at_ms if target == base else now_ms,
        inputs=inputs,
        history=history,
    )


def _stabilized(
    policy: AutoscaleConfig,
    history: Sequence[tuple[int, int]],
    now_ms: int,
    base: int,
    rec: int,
    why: str,
) -> tuple[int, str]:
    """The count the windows allow: up to the lowest recommendation of the scale-up window,
    down to the highest of the scale-down window, else ``base``."""
    sustained_up = min(_window(history, now_ms, int(policy.scale_up_window_s * 1000)))
    sustained_down = max(_window(history, now_ms, int(policy.scale_down_window_s * 1000)))
    if sustained_up > base:
        return sustained_up, why
    if sustained_down < base:
        return sustained_down, why
    if rec > base:
        return base, REASON_UP_WINDOW
    if rec < base:
        return base, REASON_DOWN_WINDOW
    return base, why
