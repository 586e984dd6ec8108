"""What one client request used: per stage, the engine seconds its engines attributed to it
(each engine step's time shared among the requests it advanced, reported back along the chain in
``StageTiming.used_ms``), and the audio seconds that went in (its input audio, said by the
route) and out (its answer's audio, counted from the answer frames as they pass).

:func:`~omni_mesh.sidecar.api.client_requests.request_frames` tallies every request's frames
into a :class:`Usage` and records it in ``/metrics`` (``observability/usage_metrics.py``) when
the frames end; routes that answer with OpenAI's ``usage`` add :meth:`Usage.extension` to it as
``usage.omni`` (a request's n choices merged)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from omni_mesh.data_plane.messages import HopResult
from omni_mesh.observability.usage_metrics import UsageMetrics


@dataclass
class Usage:
    """One request's usage (module docstring)."""

    audio_stage: int | None = None  # the stage whose outputs are the answer's audio
    stage_ms: dict[int, float] = field(default_factory=dict)  # engine ms attributed, by stage
    audio_in_s: float = 0.0
    audio_out_s: float = 0.0
    recorded: bool = False

    def add(self, frame: HopResult) -> None:
        """One answer frame: its stages' timings (on a stage's last frame) and its audio."""
        for timing in frame.timings:
            self.stage_ms[timing.stage_id] = (
                self.stage_ms.get(timing.stage_id, 0.0) + timing.used_ms
            )
        if self.audio_stage is None:
            return
        payload = frame.outputs.get(self.audio_stage)
        if payload is None or not payload.tensors:
            return
        rate = payload.fields.get("sample_rate") or 24000
        tensor = next(iter(payload.tensors.values()))
        if isinstance(rate, int | float) and rate > 0:
            self.audio_out_s += math.prod(tensor.shape) / float(rate)

    def extension(self) -> dict[str, object]:
        """``usage.omni``: engine seconds by stage, audio seconds in and out."""
        return {
            "engine_seconds": {
                str(k): round(v / 1000.0, 6) for k, v in sorted(self.stage_ms.items())
            },
            "audio_in_seconds": round(self.audio_in_s, 6),
            "audio_out_seconds": round(self.audio_out_s, 6),
        }

    def record(self, metrics: UsageMetrics, pipeline: str, tenant: str) -> None:
        """Into ``metrics``, once."""
        if self.recorded:
            return
        self.recorded = True
        seconds = {stage: ms / 1000.0 for stage, ms in self.stage_ms.items()}
        metrics.record(pipeline, tenant, seconds, self.audio_in_s, self.audio_out_s)


def merged(usages: Iterable[Usage]) -> Usage:
    """The usage of a request's choices together."""
    total = Usage()
    for usage in usages:
        for stage, ms in usage.stage_ms.items():
            total.stage_ms[stage] = total.stage_ms.get(stage, 0.0) + ms
        total.audio_in_s += usage.audio_in_s
        total.audio_out_s += usage.audio_out_s
    return total
