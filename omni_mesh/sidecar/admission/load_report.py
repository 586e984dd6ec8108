"""What a pod's heartbeats tell the control plane about its load (:func:`load_report`): the
figures the autoscaler sizes its pool from and the senders' routers weigh it by.

- ``in_flight`` / ``queued`` / ``capacity``: the pod's admitted work and admission queue, its
  engine's own queue, its ``max_inflight``;
- ``engine``: the engine's own work for the autoscaler (a hop waiting on later stages is not
  this stage's load): ``running`` (and a vLLM engine's scheduler ``waiting``), its batch, step
  time, ``max_num_seqs``, KV-cache use, and a split stage's ``prefill_tokens_queued``.

A split stage's **prefill replica** reports as ``running`` at least the slots its work held on
average since the previous heartbeat. vLLM holds a prefill request for the one step that
computes it, and the engine reads its scheduler's counts between steps: they say 0 however busy
the replica is, and the prefill pool looked idle under any load short of a queue inside vLLM.
A prefill hop never waits on a later stage (only its KV goes on), so the time it holds a slot is
the engine's work and its queue there.
"""

from __future__ import annotations

from omni_mesh.control_plane.client import LoadReport
from omni_mesh.sidecar.hop.prefill_tokens import PREFILL_TOKENS_QUEUED
from omni_mesh.sidecar.pod import Pod


def load_report(pod: Pod) -> LoadReport:
    """The pod's load now, for its next heartbeat (see the module docstring)."""
    stats = pod.engine.stats if pod.engine is not None else None
    engine: dict[str, float] = {}
    if stats is not None:
        engine = {
            "step_ms": stats.step_ms,
            "batch_size": float(stats.batch_size),
            "max_num_seqs": float(pod.stage_config.max_num_seqs),
            # Work handed to the engine and not answered yet, less its queue (the core's own
            # ``running`` counts only streams open between steps: 0 for whole answers).
            "running": float(max(0, pod.engine.in_flight - stats.queued)) if pod.engine else 0.0,
        }
        if stats.engine is not None:  # a model engine with its own scheduler (vLLM)
            engine["running"] = float(stats.engine.running)
            engine["waiting"] = float(stats.engine.waiting)
            engine["kv_cache_usage"] = stats.engine.kv_cache_usage
            if pod.stage_config.prefill is not None:  # a split stage: for the prefill picks
                engine[PREFILL_TOKENS_QUEUED] = float(stats.engine.prefill_tokens_queued)
    if pod.settings.role == "prefill" and "running" in engine and pod.gate is not None:
        engine["running"] = max(engine["running"], pod.gate.mean_in_use())
    queued = pod.gate.queued if pod.gate is not None else 0
    return LoadReport(
        in_flight=pod.in_flight + queued,  # waiters in the admission queue are load too
        queued=stats.queued if stats is not None else 0,
        capacity=pod.stage_config.max_inflight,
        engine=engine,
    )
