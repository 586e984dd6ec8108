"""What client requests used, per tenant, as an API server counts it from their answers
(``sidecar/api/usage.py``): the engine seconds of each stage attributed to them (each engine
step's time shared among the requests it advanced) and the audio seconds that went in and out.
The reference to hold them against is each stage's own busy time,
``omni_stage_engine_busy_seconds_total`` (exported by the stage pods)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from omni_mesh.observability.children import labelled
from omni_mesh.observability.tenant_labels import TenantLabels

SC_USAGE_ENGINE_SECONDS = "omni_usage_engine_seconds"
SC_USAGE_AUDIO_SECONDS = "omni_usage_audio_seconds"
SC_USAGE_REQUESTS = "omni_usage_requests"
SC_ENGINE_BUSY = "omni_stage_engine_busy_seconds"


class UsageMetrics:
    """The usage series of one API server, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry, tenants: TenantLabels | None = None) -> None:
        self.tenants = tenants or TenantLabels()
        self.engine_seconds = Counter(
            SC_USAGE_ENGINE_SECONDS,
            "Engine seconds of each stage attributed to client requests (each engine step's "
            "time shared among the requests it advanced).",
            ["pipeline", "tenant", "stage"],
            registry=registry,
        )
        self.audio_seconds = Counter(
            SC_USAGE_AUDIO_SECONDS,
            "Audio seconds of client requests: their input audio (in) and their answers' (out).",
            ["pipeline", "tenant", "direction"],
            registry=registry,
        )
        self.requests = Counter(
            SC_USAGE_REQUESTS,
            "Client requests whose usage was counted (each choice of an n-choice request).",
            ["pipeline", "tenant"],
            registry=registry,
        )
        # A stage pod's: its engine's stepping time, what the requests' shares add up to.
        self.engine_busy = Counter(
            SC_ENGINE_BUSY,
            "The engine's stepping time (what usage's engine seconds are shares of).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self._busy_exported = 0.0  # the engine's busy total at the last scrape

    def export_busy(self, labels: tuple[str, str], busy_s: float) -> None:
        """Add what the engine's busy total grew by since the last scrape (an engine that
        restarted counts from zero again)."""
        last, self._busy_exported = self._busy_exported, busy_s
        grown = busy_s - last if busy_s >= last else busy_s
        if grown > 0:
            self.engine_busy.labels(*labels).inc(grown)

    def record(
        self,
        pipeline: str,
        tenant: str,
        stage_seconds: dict[int, float],
        audio_in_s: float,
        audio_out_s: float,
    ) -> None:
        """One request's usage."""
        name = self.tenants(tenant)
        labelled(self.requests, pipeline, name).inc()
        for stage, seconds in stage_seconds.items():
            if seconds > 0:
                labelled(self.engine_seconds, pipeline, name, str(stage)).inc(seconds)
        if audio_in_s > 0:
            labelled(self.audio_seconds, pipeline, name, "in").inc(audio_in_s)
        if audio_out_s > 0:
            labelled(self.audio_seconds, pipeline, name, "out").inc(audio_out_s)
