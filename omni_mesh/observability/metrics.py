"""Every metric of omni-mesh: names, help texts, labels and buckets, in one module.

Organised by section, one per component. A section holds the metric *names* as constants (so
dashboards, alerts and tests refer to one spelling) and a small class that creates the metrics
in a given :class:`~prometheus_client.CollectorRegistry`. Each process (or each in-process test
app) passes its own registry, never the global default one, so several apps can live in one
process without "Duplicated timeseries" errors.

Naming: ``omni_<component>_<what>[_<unit>]``; counters are declared without ``_total`` (the
client library appends it on exposition).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omni_mesh.observability.audio_slo import AudioSloMetrics
from omni_mesh.observability.autoscale_metrics import AutoscaleMetrics
from omni_mesh.observability.gc_metrics import ProcessGcMetrics
from omni_mesh.observability.kv_metrics import KvMetrics
from omni_mesh.observability.tenant_labels import TenantLabels
from omni_mesh.observability.usage_metrics import UsageMetrics

__all__ = ["AutoscaleMetrics", "ControlPlaneMetrics", "SidecarMetrics"]

# Latency buckets (seconds) for in-cluster HTTP APIs: 0.5 ms .. 10 s.
HTTP_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# ==============================================================================================
# Control plane (omni-cp)
# ==============================================================================================

CP_INSTANCES = "omni_cp_instances"
CP_REGISTRATIONS = "omni_cp_registrations"
CP_DEREGISTRATIONS = "omni_cp_deregistrations"
CP_LEASE_EXPIRIES = "omni_cp_lease_expiries"
CP_ISOLATIONS = "omni_cp_isolations"
CP_EVICTIONS = "omni_cp_evictions"
CP_SUSPECTS = "omni_cp_suspects"
CP_PROBES = "omni_cp_probes"
CP_PROBE_DURATION = "omni_cp_probe_duration_seconds"
CP_WATCHERS = "omni_cp_watchers"
CP_SWEEPER_LEADER = "omni_cp_sweeper_leader"
CP_SWEEP_DURATION = "omni_cp_sweep_duration_seconds"
CP_REQUEST_DURATION = "omni_cp_http_request_duration_seconds"
CP_SESSIONS = "omni_cp_sessions"
# Label values of the "state" label (mirrors control_plane.schema.InstanceState).
CP_INSTANCE_STATES: tuple[str, ...] = ("healthy", "standby", "isolated", "draining")


class ControlPlaneMetrics:
    """The metrics of one ``omni-cp`` app, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.instances = Gauge(
            CP_INSTANCES,
            "Registered stage instances by pipeline, stage and state (refreshed on scrape).",
            ["pipeline", "stage", "state"],
            registry=registry,
        )
        self.registrations = Counter(
            CP_REGISTRATIONS,
            "Instance registrations accepted by this omni-cp.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.deregistrations = Counter(
            CP_DEREGISTRATIONS,
            "Graceful instance leaves handled by this omni-cp.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.lease_expiries = Counter(
            CP_LEASE_EXPIRIES,
            "Instances isolated by the sweeper because their lease lapsed.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.isolations = Counter(
            CP_ISOLATIONS,
            "Instance isolations by reason (lease_expired, unreachable or an operator's reason).",
            ["pipeline", "stage", "reason"],
            registry=registry,
        )
        self.evictions = Counter(
            CP_EVICTIONS,
            "Records of long-dead instances deleted by the sweeper.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.suspects = Counter(
            CP_SUSPECTS,
            "Suspect reports (a sender could not connect to an instance) received.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.probes = Counter(
            CP_PROBES,
            "Probes of suspect instances by outcome (answered, refused, reset, timeout, ...).",
            ["pipeline", "stage", "outcome"],
            registry=registry,
        )
        self.probe_duration = Histogram(
            CP_PROBE_DURATION,
            "Duration of one probe (GET {address}/health) of a suspect instance.",
            buckets=HTTP_LATENCY_BUCKETS,
            registry=registry,
        )
        self.watchers = Gauge(
            CP_WATCHERS,
            "Watch requests (long-poll or SSE) currently open on this omni-cp.",
            ["mode"],
            registry=registry,
        )
        self.sweeper_leader = Gauge(
            CP_SWEEPER_LEADER,
            "1 while this omni-cp holds the sweeper lock, else 0.",
            registry=registry,
        )
        self.sweep_duration = Histogram(
            CP_SWEEP_DURATION,
            "Duration of one sweeper tick (lease expiry and eviction) on the lock holder.",
            buckets=HTTP_LATENCY_BUCKETS,
            registry=registry,
        )
        self.request_duration = Histogram(
            CP_REQUEST_DURATION,
            "Control-plane API request latency by route template, method and status.",
            ["route", "method", "status"],
            buckets=HTTP_LATENCY_BUCKETS,
            registry=registry,
        )
        self.sessions = Gauge(
            CP_SESSIONS,
            "Realtime sessions by pipeline and state (owned, released), refreshed on scrape.",
            ["pipeline", "state"],
            registry=registry,
        )
        self.autoscale = AutoscaleMetrics(registry)


# ==============================================================================================
# Data plane / sidecar / engines: sections appended below by their owners.
# ==============================================================================================


# ==============================================================================================
# Stage sidecar (omni-stage)
# ==============================================================================================

SC_REQUESTS = "omni_stage_requests"
SC_REQUEST_DURATION = "omni_stage_request_duration_seconds"
SC_IN_FLIGHT = "omni_stage_in_flight"
SC_REJECTED = "omni_stage_rejected"
SC_HOP_RETRIES = "omni_stage_hop_retries"
SC_HANDOFF_BYTES = "omni_stage_handoff_bytes"
SC_HANDOFF_DURATION = "omni_stage_handoff_duration_seconds"
SC_ENGINE_QUEUE = "omni_stage_engine_queued"
SC_ENGINE_STEP = "omni_stage_engine_step_seconds"
SC_AFFINITY_PICKS = "omni_stage_affinity_picks"
SC_ENGINE_RUNNING = "omni_stage_engine_running_requests"
SC_ENGINE_WAITING = "omni_stage_engine_waiting_requests"
SC_ENGINE_KV_CACHE = "omni_stage_engine_kv_cache_usage"
SC_ENGINE_TOKENS = "omni_stage_engine_generation_tokens_per_second"
SC_API_REQUESTS = "omni_api_requests"
SC_API_DURATION = "omni_api_request_duration_seconds"
SC_CHUNKS = "omni_stage_output_chunks"
SC_HOP_FRAMES = "omni_stage_hop_frames"
SC_INPUT_CHUNKS = "omni_stage_input_chunks"
SC_API_FIRST_CHUNK = "omni_api_first_chunk_seconds"
# Admission queue (overload): per stage and priority class.
SC_QUEUE_LENGTH = "omni_stage_queue_length"
SC_QUEUE_WAIT = "omni_stage_queue_wait_seconds"
SC_SHED = "omni_stage_shed"
SC_ADMITTED = "omni_stage_admitted"
# Realtime sessions (/v1/realtime) of an API server.
SC_REALTIME_SESSIONS = "omni_realtime_sessions"
SC_REALTIME_RESPONSES = "omni_realtime_responses"
SC_REALTIME_FIRST_AUDIO = "omni_realtime_first_audio_seconds"

# Latency buckets (seconds) for whole stage executions and pipelines: 1 ms .. 2 min.
STAGE_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class SidecarMetrics:
    """The metrics of one stage sidecar (or API server), registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.gc = ProcessGcMetrics(registry)
        self.kv = KvMetrics(registry)  # a split stage's KV hand-offs and transfers
        tenants = TenantLabels()  # one bound on tenant label values for the whole process
        self.audio = AudioSloMetrics(registry, tenants)  # an API server's streamed audio answers
        self.usage = UsageMetrics(registry, tenants)  # what client requests used, per tenant
        self.requests = Counter(
            SC_REQUESTS,
            "Stage executions by entry point (hop, run) and outcome.",
            ["pipeline", "stage", "route", "outcome"],
            registry=registry,
        )
        self.request_duration = Histogram(
            SC_REQUEST_DURATION,
            "Latency of a stage execution including everything downstream of it (hop) or of "
            "the stage alone (run).",
            ["pipeline", "stage", "route"],
            buckets=STAGE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            SC_IN_FLIGHT,
            "Requests this sidecar is executing now.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.rejected = Counter(
            SC_REJECTED,
            "Requests refused at admission (draining → 503, duplicate → 409); see omni_stage_shed.",
            ["pipeline", "stage", "reason"],
            registry=registry,
        )
        self.hop_retries = Counter(
            SC_HOP_RETRIES,
            "Hops replayed on another replica after a failure before an answer.",
            ["pipeline", "from_stage", "to_stage"],
            registry=registry,
        )
        self.handoff_bytes = Counter(
            SC_HANDOFF_BYTES,
            "Bytes of hop bodies sent per stage pair (shm hand-offs carry handles only).",
            ["pipeline", "from_stage", "to_stage"],
            registry=registry,
        )
        self.handoff_duration = Histogram(
            SC_HANDOFF_DURATION,
            "Time from sending a hop to its answer (includes the downstream stages).",
            ["pipeline", "from_stage", "to_stage"],
            buckets=STAGE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.engine_queued = Gauge(
            SC_ENGINE_QUEUE,
            "Requests waiting in the engine's queue (from its last stats report).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.engine_step = Gauge(
            SC_ENGINE_STEP,
            "Duration of the engine's last step.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.affinity_picks = Counter(
            SC_AFFINITY_PICKS,
            "Replicas picked for hops with session affinity: home (the session's replica) or "
            "moved (it was full, ejected or gone: the next with room).",
            ["pipeline", "from_stage", "to_stage", "outcome"],
            registry=registry,
        )
        # A model engine with its own scheduler (vLLM) reports these (Stats.engine).
        self.engine_running = Gauge(
            SC_ENGINE_RUNNING,
            "Requests in the model engine's running batch (vLLM's scheduler).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.engine_waiting = Gauge(
            SC_ENGINE_WAITING,
            "Requests queued inside the model engine (vLLM's scheduler).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.engine_kv_cache = Gauge(
            SC_ENGINE_KV_CACHE,
            "Fraction of the model engine's KV cache in use (0..1).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.engine_tokens = Gauge(
            SC_ENGINE_TOKENS,
            "Tokens the model engine generated per second (since its previous report).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.api_requests = Counter(
            SC_API_REQUESTS,
            "Client API requests by route and status.",
            ["route", "status"],
            registry=registry,
        )
        self.api_duration = Histogram(
            SC_API_DURATION,
            "Client API latency by route.",
            ["route"],
            buckets=STAGE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.output_chunks = Counter(
            SC_CHUNKS,
            "Output chunks this stage's engine emitted (async_chunk): chunks of its own stream "
            "or its outputs for chunks of an upstream one; whole outputs are not counted.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.hop_frames = Counter(
            SC_HOP_FRAMES,
            "Frames sent in streamed hop answers (async_chunk).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.input_chunks = Counter(
            SC_INPUT_CHUNKS,
            "Later chunks of streamed inputs (a stage with stream_input) this stage pulled from "
            "its source and fed to its engine while the request ran.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.api_first_chunk = Histogram(
            SC_API_FIRST_CHUNK,
            "Streaming client API: time from the request to its first output bytes sent.",
            ["route"],
            buckets=STAGE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_length = Gauge(
            SC_QUEUE_LENGTH,
            "Requests waiting in this pod's admission queue, by priority class.",
            ["pipeline", "stage", "priority"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            SC_QUEUE_WAIT,
            "Time admitted requests waited in the admission queue, by priority class.",
            ["pipeline", "stage", "priority"],
            buckets=STAGE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.shed = Counter(
            SC_SHED,
            "Requests shed at admission (503, never started) by reason and priority class.",
            ["pipeline", "stage", "reason", "priority"],
            registry=registry,
        )
        self.admitted = Counter(
            SC_ADMITTED,
            "Requests admitted into a slot (at once or after queueing), by priority class.",
            ["pipeline", "stage", "priority"],
            registry=registry,
        )
        self.realtime_sessions = Gauge(
            SC_REALTIME_SESSIONS,
            "Realtime WebSocket sessions this API server holds, by state (idle, speaking: the "
            "VAD hears the user, responding).",
            ["pipeline", "state"],
            registry=registry,
        )
        self.realtime_responses = Counter(
            SC_REALTIME_RESPONSES,
            "Realtime responses by final status (completed, incomplete, cancelled, failed).",
            ["pipeline", "status"],
            registry=registry,
        )
        self.realtime_first_audio = Histogram(
            SC_REALTIME_FIRST_AUDIO,
            "Realtime: from response start (commit or response.create) to its first audio delta.",
            ["pipeline"],
            buckets=STAGE_LATENCY_BUCKETS,
            registry=registry,
        )
