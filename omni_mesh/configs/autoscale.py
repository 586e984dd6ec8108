"""The ``autoscale:`` section of a stage's deploy entry: the knobs of the control plane's
per-stage autoscaling policy (see docs/operations.md, "Autoscaling").

The same model is the body the launcher ``PUT``s on the control plane's stage scale resource, so
the YAML key and the API field can never disagree. ``num_replicas`` of an autoscaled stage is its
starting count and must lie in ``[min_replicas, max_replicas]`` (checked by the stage model).
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_mesh.configs.deploy_fields import MAX_LATENCY_MS, MAX_REPLICAS

__all__ = ["MAX_WINDOW_S", "AutoscaleConfig"]

#: Longest stabilization window or cooldown, seconds.
MAX_WINDOW_S = 3600.0


class AutoscaleConfig(BaseModel):
    """How a stage's pool follows its load: bounds, target, windows, step limits, cooldown."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description="Fewest replicas; 0 lets an idle stage scale to zero.",
    )
    max_replicas: int = Field(
        default=4, ge=1, le=MAX_REPLICAS, description="Most replicas the policy asks for."
    )
    target_utilization: float = Field(
        default=0.6,
        gt=0.0,
        le=1.0,
        description="Load per replica the policy aims at, as a fraction of its capacity.",
    )
    tolerance: float = Field(
        default=0.1,
        ge=0.0,
        le=0.5,
        description="Utilization within target x (1 +- tolerance) changes nothing (no flapping).",
    )
    scale_up_window_s: float = Field(
        default=3.0,
        ge=0.0,
        le=MAX_WINDOW_S,
        description="Load must ask for more replicas this long before the policy adds them.",
    )
    scale_down_window_s: float = Field(
        default=60.0,
        ge=0.0,
        le=MAX_WINDOW_S,
        description="Load must ask for fewer replicas this long before the policy removes any.",
    )
    max_scale_up_step: int = Field(
        default=4, ge=1, le=MAX_REPLICAS, description="Most replicas added by one decision."
    )
    max_scale_down_step: int = Field(
        default=1, ge=1, le=MAX_REPLICAS, description="Most replicas removed by one decision."
    )
    cooldown_s: float = Field(
        default=5.0,
        ge=0.0,
        le=MAX_WINDOW_S,
        description="Least time between two changes of the desired count, seconds.",
    )
    standby_replicas: int = Field(
        default=0,
        ge=0,
        le=MAX_REPLICAS,
        description="Warm replicas kept started, loaded and registered as standby (never "
        "routed to) beyond the desired count; the autoscaler promotes one in well under a "
        "second when the stage needs a replica, and omni-up starts its replacement.",
    )
    target_latency_ms: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_LATENCY_MS,
        description="Estimated queue + step time per request to stay under; null = no target.",
    )
    target_queue_wait_ms: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_LATENCY_MS,
        description="Mean time a request waits at a replica (its admission queue, then its "
        "engine's queue) before its engine starts it, as the replicas report it, to stay under; "
        "null = no target.",
    )
    target_first_audio_p95_ms: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_LATENCY_MS,
        description="p95 time to first audio of the pipeline's streamed audio answers over the "
        "last 10 s, as its API servers measure it, to stay under by sizing this stage's pool "
        "(the talker's, say); null = no target.",
    )
    target_realtime_factor_p5: float | None = Field(
        default=None,
        ge=0.01,
        le=100.0,
        description="p5 real-time factor (audio seconds over the wall seconds to the last "
        "audio bytes) of the pipeline's streamed audio answers over the last 10 s, as its API "
        "servers measure it, to stay above by sizing this stage's pool; null = no target.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> Self:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be at least min_replicas "
                f"({self.min_replicas})"
            )
        return self

    def clamp(self, replicas: int) -> int:
        """``replicas`` bounded to ``[min_replicas, max_replicas]``."""
        return max(self.min_replicas, min(self.max_replicas, replicas))
