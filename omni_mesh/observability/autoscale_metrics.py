"""The control plane's autoscaling series (``control_plane/autoscaling/``): each autoscaled
stage's decided, recommended, ready and standby replicas and the figures they were decided
from, refreshed from Redis on every scrape so every omni-cp serves the same values
(``ControlPlaneMetrics.autoscale`` in ``metrics.py``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# Autoscaling (gauges refreshed from Redis on scrape: every omni-cp serves the same values).
CP_DESIRED_REPLICAS = "omni_cp_desired_replicas"
CP_RECOMMENDED_REPLICAS = "omni_cp_recommended_replicas"
CP_READY_REPLICAS = "omni_cp_ready_replicas"
CP_STAGE_UTILIZATION = "omni_cp_stage_utilization"
CP_STAGE_QUEUED = "omni_cp_stage_queued"
CP_STAGE_LATENCY = "omni_cp_stage_estimated_latency_seconds"
CP_STAGE_QUEUE_WAIT = "omni_cp_stage_queue_wait_seconds"
CP_STAGE_FIRST_AUDIO = "omni_cp_stage_first_audio_p95_seconds"
CP_STAGE_RTF = "omni_cp_stage_realtime_factor_p5"
CP_STAGE_KV_CACHE = "omni_cp_stage_kv_cache_usage"
CP_SCALE_DECISIONS = "omni_cp_scale_decisions"
CP_STANDBY_REPLICAS = "omni_cp_standby_replicas"
CP_STANDBY_PROMOTIONS = "omni_cp_standby_promotions"


class AutoscaleMetrics:
    """Autoscaling figures of one ``omni-cp``: the last decision per stage and its inputs."""

    def __init__(self, registry: CollectorRegistry) -> None:
        stage = ["pipeline", "stage"]
        self.desired = Gauge(
            CP_DESIRED_REPLICAS,
            "Replicas the autoscaling policy wants for the stage (last decision).",
            stage,
            registry=registry,
        )
        self.recommended = Gauge(
            CP_RECOMMENDED_REPLICAS,
            "Replicas the stage's load alone asks for, before windows, steps and cooldown.",
            stage,
            registry=registry,
        )
        self.ready = Gauge(
            CP_READY_REPLICAS,
            "Healthy replicas of an autoscaled stage when it was last decided.",
            stage,
            registry=registry,
        )
        self.utilization = Gauge(
            CP_STAGE_UTILIZATION,
            "Mean load per ready replica over its capacity (what the policy compares to target).",
            stage,
            registry=registry,
        )
        self.queued = Gauge(
            CP_STAGE_QUEUED,
            "Requests waiting in the engines of an autoscaled stage.",
            stage,
            registry=registry,
        )
        self.latency = Gauge(
            CP_STAGE_LATENCY,
            "Estimated queue + step time of a new request at the stage (engine figures).",
            stage,
            registry=registry,
        )
        self.queue_wait = Gauge(
            CP_STAGE_QUEUE_WAIT,
            "Mean time requests waited at the stage's replicas before their engines started "
            "them, as the replicas last reported it (mean over them).",
            stage,
            registry=registry,
        )
        self.first_audio = Gauge(
            CP_STAGE_FIRST_AUDIO,
            "p95 time to first audio of the pipeline's streamed audio answers over the last "
            "seconds, as its API servers measured it (for a stage that targets it).",
            stage,
            registry=registry,
        )
        self.realtime_factor = Gauge(
            CP_STAGE_RTF,
            "p5 real-time factor of the pipeline's streamed audio answers over the last seconds, "
            "as its API servers measured it (for a stage that targets it).",
            stage,
            registry=registry,
        )
        self.kv_cache = Gauge(
            CP_STAGE_KV_CACHE,
            "Highest KV-cache use (0..1) reported by a ready replica of the stage.",
            stage,
            registry=registry,
        )
        self.decisions = Counter(
            CP_SCALE_DECISIONS,
            "Autoscaling decisions made by this omni-cp (lock holder) by direction and reason.",
            [*stage, "direction", "reason"],
            registry=registry,
        )
        self.standby = Gauge(
            CP_STANDBY_REPLICAS,
            "Warm standby replicas of an autoscaled stage (not routed to) when it was last "
            "decided.",
            stage,
            registry=registry,
        )
        self.promotions = Counter(
            CP_STANDBY_PROMOTIONS,
            "Standby replicas this omni-cp (lock holder) promoted into their stage's pool.",
            stage,
            registry=registry,
        )

    def stage_gauges(self) -> tuple[Gauge, ...]:
        """Every per-stage gauge (cleared and set again on each scrape)."""
        return (
            self.desired,
            self.recommended,
            self.ready,
            self.utilization,
            self.queued,
            self.latency,
            self.queue_wait,
            self.first_audio,
            self.realtime_factor,
            self.kv_cache,
            self.standby,
        )
