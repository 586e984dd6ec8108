"""What a pod's heartbeats tell the control plane about its load (:func:`load_report`): the
figures the autoscaler sizes its pool from and the senders' routers weigh it by.

- ``in_flight`` / ``queued`` / ``capacity``: the pod's admitted work and admission queue, its
  engine's own queue, its ``max_inflight``;
- ``engine``: the engine's own work for the autoscaler (a hop waiting on later stages is not
  this stage's load): ``running`` (and a vLLM engine's scheduler ``waiting``), its batch, step
  time, ``max_num_seqs``, KV-cache use, and a split stage's ``prefill_tokens_queued``;
- ``engine["queue_wait_ms"]`` (:data:`~omni_mesh.control_plane.client.ENGINE_QUEUE_WAIT_MS`):
  how long the requests that started since the previous heartbeat waited before the engine
  started them, on average: in the pod's admission queue, then in the engine's own queue (its
  first output says), at least the age of the oldest request still in the admission queue
  (``autoscale: target_queue_wait_ms``). vLLM's own scheduler queue is not in it;
- ``engine["occupancy"]`` (:data:`~omni_mesh.control_plane.client.ENGINE_OCCUPANCY`): the
  engine's work (handed to it and not answered: running or queued there) **averaged over the
  time since the previous heartbeat**, which the autoscaler sizes the pool from. ``running``
  and the others are read at one instant: a stage with a trickle of short requests shows one
  in flight at a few instants and none at the rest, and a policy reading the instant's count
  asked for a replica more whenever a heartbeat caught one.

A split stage's **prefill replica** reports as ``running`` and ``occupancy`` at least the slots
its work held on average since the previous heartbeat. vLLM holds a prefill request for the one
step that computes it, and the engine reads its scheduler's counts between steps: they say 0
however busy the replica is, and the prefill pool looked idle under any load short of a queue
inside vLLM. A prefill hop never waits on a later stage (only its KV goes on), so the time it
holds a slot is the engine's work and its queue there.

An API server (a pod that serves the client API, with an engine or ``--api-only``) also reports
its streamed audio answers' time to first audio and real-time factor over the last seconds
(``first_audio_le_<s>``, ``first_audio_count``, ``rtf_le_<x>``, ``rtf_count``:
:data:`~omni_mesh.control_plane.client.ENGINE_FIRST_AUDIO_LE`), snapshots of its sliding windows
(``observability/window_histogram.py``) while they hold a sample. The autoscaler merges the
windows of the pipeline's API servers for a pool that sets ``target_first_audio_p95_ms`` or
``target_realtime_factor_p5``.
"""

from __future__ import annotations

import time

from omni_mesh.control_plane.client import (
    ENGINE_FIRST_AUDIO_COUNT,
    ENGINE_FIRST_AUDIO_LE,
    ENGINE_OCCUPANCY,
    ENGINE_QUEUE_WAIT_MS,
    ENGINE_RTF_COUNT,
    ENGINE_RTF_LE,
    LoadReport,
)
from omni_mesh.observability.window_histogram import WindowHistogram
from omni_mesh.sidecar.hop.prefill_tokens import PREFILL_TOKENS_QUEUED
from omni_mesh.sidecar.pod import Pod


def load_report(pod: Pod) -> LoadReport:
    """The pod's load for its next heartbeat (see the module docstring): the averaged figures
    cover the time since the previous call, so only the heartbeats call it."""
    client = pod.engine
    stats = client.stats if client is not None else None
    engine: dict[str, float] = {}
    if client is not None and stats is not None:
        engine = {
            "step_ms": stats.step_ms,
            "batch_size": float(stats.batch_size),
            "max_num_seqs": float(pod.stage_config.max_num_seqs),
            # Work handed to the engine and not answered yet, less its queue (the core's own
            # ``running`` counts only streams open between steps: 0 for whole answers).
            "running": float(max(0, client.in_flight - stats.queued)),
            # The same work, queue included, averaged since the previous heartbeat.
            ENGINE_OCCUPANCY: client.mean_in_flight(),
            ENGINE_QUEUE_WAIT_MS: queue_wait_ms(pod),
        }
        if stats.engine is not None:  # a model engine with its own scheduler (vLLM)
            engine["running"] = float(stats.engine.running)
            engine["waiting"] = float(stats.engine.waiting)
            engine["kv_cache_usage"] = stats.engine.kv_cache_usage
            if pod.stage_config.prefill is not None:  # a split stage: for the prefill picks
                engine[PREFILL_TOKENS_QUEUED] = float(stats.engine.prefill_tokens_queued)
    if pod.settings.role == "prefill" and "running" in engine and pod.gate is not None:
        held = pod.gate.mean_in_use()
        engine["running"] = max(engine["running"], held)
        engine[ENGINE_OCCUPANCY] = max(engine[ENGINE_OCCUPANCY], held)
    if pod.serves_api:
        audio, now = pod.metrics.audio, time.monotonic()
        engine.update(window_figures(audio.first_window, now, ENGINE_FIRST_AUDIO_LE))
        engine.update(window_figures(audio.rtf_window, now, ENGINE_RTF_LE, ENGINE_RTF_COUNT))
    queued = pod.gate.queued if pod.gate is not None else 0
    return LoadReport(
        in_flight=pod.in_flight + queued,  # waiters in the admission queue are load too
        queued=stats.queued if stats is not None else 0,
        capacity=pod.stage_config.max_inflight,
        engine=engine,
    )


def queue_wait_ms(pod: Pod) -> float:
    """The mean wait since the previous heartbeat, ms (see the module docstring): the mean
    admission wait of the requests admitted in the interval plus the mean engine-queue wait of
    those the engine started in it. Nearly the same requests (one admitted at the end of an
    interval starts early in the next), and a mean of sums is the sum of the means."""
    admission_s = pod.gate.mean_wait_s() if pod.gate is not None else 0.0
    engine_ms = pod.engine.mean_queue_wait_ms() if pod.engine is not None else 0.0
    return admission_s * 1000.0 + engine_ms


def window_figures(
    window: WindowHistogram,
    now: float,
    prefix: str = ENGINE_FIRST_AUDIO_LE,
    count: str = ENGINE_FIRST_AUDIO_COUNT,
) -> dict[str, float]:
    """The window's snapshot as engine figures ``<prefix><bound>`` and ``count`` (see the
    module docstring): nothing while it holds no sample."""
    cumulative, total = window.snapshot(now)
    if total == 0:
        return {}
    figures = {f"{prefix}{bound:g}": float(n) for bound, n in cumulative}
    figures[count] = float(total)
    return figures
