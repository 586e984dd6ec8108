"""Every message of the control-plane HTTP API: one typed model per body, shared by the server
(``api/``) and the client that sidecars use (``client/``).

Requests are strict (no type coercion, unknown fields rejected) and bounded; responses ignore
fields they do not know, so an older client keeps working against a newer server. The API is
versioned by its path (``/v1``); instance records in Redis carry ``keys.RECORD_SCHEMA_VERSION``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.deploy_fields import MAX_REPLICAS

MAX_BODY_BYTES = 64 * 1024
MAX_LABELS = 32
MAX_SETTINGS = 16
MAX_ENGINE_METRICS = 64
MAX_CAPACITY = 65536
MAX_STAGE_ID = 63

REASON_LEASE_EXPIRED = "lease_expired"
REASON_UNREACHABLE = "unreachable"
REASON_OPERATOR = "operator"
REASON_DRAIN = "drain"
#: Isolation reasons the control plane gives itself; the instance's next heartbeat readmits it.
#: Operators cannot use them (an operator's isolation must survive heartbeats).
AUTOMATIC_REASONS: frozenset[str] = frozenset({REASON_LEASE_EXPIRED, REASON_UNREACHABLE})
MAX_REASON_CHARS = 128

PipelineNameStr = Annotated[str, StringConstraints(min_length=1, max_length=48)]
HostId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")]
LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/\-]{0,62}$")]
LabelValue = Annotated[str, StringConstraints(max_length=256)]
SettingName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,47}$")]
SettingValue = Annotated[str, StringConstraints(max_length=256)]
MetricName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.:\-]{0,63}$")]
Reason = Annotated[str, StringConstraints(pattern=r"^[\x20-\x7e]{1,128}$")]
Reporter = Annotated[str, StringConstraints(pattern=r"^[\x20-\x7e]{1,256}$")]
MetricValue = Annotated[float, Field(allow_inf_nan=False)]


def clean_reason(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` made acceptable as a :data:`Reason`: printable ASCII, one line, at most ``limit``
    characters (an exception's text may be anything)."""
    flat = " ".join(text.split())
    printable = "".join(c if " " <= c <= "~" else "?" for c in flat)
    if len(printable) > limit:
        printable = printable[: limit - 3] + "..."
    return printable or "unspecified"


def _not_automatic(value: str) -> str:
    if value in AUTOMATIC_REASONS:
        raise ValueError(f"{value!r} is reserved for the control plane's own isolations")
    return value


class InstanceState(StrEnum):
    """Routing state of an instance. Only ``healthy`` instances are handed to routers."""

    HEALTHY = "healthy"
    STANDBY = "standby"  # warm (started, loaded, heartbeating); the autoscaler promotes it
    ISOLATED = "isolated"  # lease lapsed (lease_expired), probe failed (unreachable), or operator
    DRAINING = "draining"  # finishing its work; receives no new requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# ---- requests ----------------------------------------------------------------------------------


def validate_address(value: str) -> str:
    """An ``http(s)://host:port[/path]`` base URL, without credentials, query or fragment."""
    if len(value) > 512:
        raise ValueError("must be at most 512 characters")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("must name a host")
    if port is None or port == 0:
        raise ValueError("must name a port (http://host:port)")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials")
    if parts.query or parts.fragment:
        raise ValueError("must not have a query or fragment")
    return value.rstrip("/")


#: The registration label naming a split stage's pool: ``prefill`` or ``decode`` (the
#: deploy config's ``prefill:``; routers send prefill requests only to the prefill pool).
KV_ROLE_LABEL = "kv_role"


class ScalePool(StrEnum):
    """Which pool of a stage a scale resource sizes (query parameter ``pool`` of the scale
    routes): the stage's own pool, or a split stage's prefill pool, which autoscales apart."""

    STAGE = "stage"  # the stage's replicas; a split stage's decode pool (no kv_role=prefill)
    PREFILL = "prefill"  # a split stage's prefill pool: its replicas labelled kv_role=prefill

    def holds(self, labels: Mapping[str, str]) -> bool:
        """Whether a replica registered with ``labels`` belongs to this pool."""
        return (labels.get(KV_ROLE_LABEL) == "prefill") == (self is ScalePool.PREFILL)

    def where(self, stage_id: int) -> str:
        """``stage=N`` (``stage=N pool=prefill``): how logs name the pool."""
        return f"stage={stage_id}" if self is ScalePool.STAGE else f"stage={stage_id} pool={self}"

    def label(self, stage_id: int) -> str:
        """The ``stage`` label of the pool's autoscaling metrics: ``N`` (``N/prefill``)."""
        return str(stage_id) if self is ScalePool.STAGE else f"{stage_id}/{self}"


#: The ``LoadReport.engine`` figure of a replica's time-averaged load: the work its engine held
#: (handed to it and not answered: running or queued there) on average since the replica's
#: previous heartbeat, the integral of that count over the interval divided by the interval.
#: The autoscaler sizes a pool from it where reported (instead of ``running``, a count read at
#: one instant). A free-form engine figure rather than a field of its own, so that a control
#: plane that predates it still takes the heartbeat (requests refuse unknown fields), and one
#: that knows it still reads a heartbeat without it (a rolling upgrade mixes both).
ENGINE_OCCUPANCY = "occupancy"
#: The ``LoadReport.engine`` figure of a replica's queue wait, ms: the mean time the requests
#: that started since its previous heartbeat waited there (in its admission queue, then in its
#: engine's queue) before its engine started them, at least the age of the oldest request still
#: waiting in its admission queue. ``autoscale: target_queue_wait_ms`` reads it.
ENGINE_QUEUE_WAIT_MS = "queue_wait_ms"
#: The ``LoadReport.engine`` figures of an API server's time to first audio over its last few
#: seconds (a sliding window, ``observability/window_histogram.py``): ``first_audio_le_<s>``,
#: the streamed audio answers whose first audio bytes left within ``<s>`` seconds of the request
#: (cumulative, one per bucket bound), and ``first_audio_count``, all of them. A snapshot of the
#: window, not a change since the previous heartbeat, so a report read in several decisions
#: counts once in each. ``autoscale: target_first_audio_p95_ms`` reads them from the pipeline's
#: API servers; sent only while the window holds a sample.
ENGINE_FIRST_AUDIO_LE = "first_audio_le_"
ENGINE_FIRST_AUDIO_COUNT = "first_audio_count"
#: The same of the answers' real-time factor (audio seconds over the wall seconds from the
#: request to its last audio bytes): ``rtf_le_<x>`` and ``rtf_count``. ``autoscale:
#: target_realtime_factor_p5`` reads them.
ENGINE_RTF_LE = "rtf_le_"
ENGINE_RTF_COUNT = "rtf_count"


class LoadReport(_Request):
    """Load of one instance, carried by each heartbeat. Updating it does not bump the version."""

    in_flight: int = Field(default=0, ge=0, le=10_000_000, description="Requests executing.")
    queued: int = Field(default=0, ge=0, le=10_000_000, description="Requests waiting.")
    capacity: int = Field(
        default=0, ge=0, le=MAX_CAPACITY, description="Requests it can run concurrently now."
    )
    engine: dict[MetricName, MetricValue] = Field(
        default_factory=dict,
        max_length=MAX_ENGINE_METRICS,
        description="Engine figures (kv_cache_usage, step_ms, ...).",
    )


class RegisterRequest(_Request):
    """``POST /v1/instances``: an instance of one stage of a pipeline joins its pool."""

    pipeline: PipelineNameStr = Field(description="Registered pipeline name.")
    stage_id: int = Field(ge=0, le=MAX_STAGE_ID, description="Stage of the pipeline it serves.")
    address: str = Field(description="Base URL other stages reach it on (http://host:port).")
    capacity: int = Field(ge=1, le=MAX_CAPACITY, description="Concurrent requests it accepts.")
    host_id: HostId | None = Field(
        default=None, description="Physical host (same-host peers use shm); default: URL host."
    )
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, max_length=MAX_LABELS, description="Free-form tags."
    )
    role: Literal["stage", "api"] = Field(
        default="stage",
        description="stage: joins the stage's pool; api: an API server running no stage "
        "(--api-only), listed by status but never routed to.",
    )
    standby: bool = Field(
        default=False,
        description="Join as a warm standby (state standby: listed, never routed to) that the "
        "autoscaler promotes to healthy when the stage needs a replica.",
    )
    settings: dict[SettingName, SettingValue] = Field(
        default_factory=dict,
        max_length=MAX_SETTINGS,
        description="Pipeline-wide settings every pod of the pipeline must agree on; a value "
        "that differs from the live pods' is refused with 409 naming the setting.",
    )

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        return validate_address(value)

    @property
    def effective_host_id(self) -> str:
        return self.host_id or (urlsplit(self.address).hostname or "")


class HeartbeatRequest(_Request):
    """``PUT /v1/instances/{id}/heartbeat``: renew the lease and report load."""

    load: LoadReport = Field(default_factory=LoadReport, description="Current load.")


class IsolateRequest(_Request):
    """``POST /v1/instances/{id}/isolate``: an operator takes an instance out of its pool."""

    reason: Reason = Field(default=REASON_OPERATOR, description="Why (shown by status).")

    @field_validator("reason")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        return _not_automatic(value)


class DrainRequest(_Request):
    """``POST /v1/instances/{id}/drain``: the instance finishes its work, gets nothing new."""

    reason: Reason = Field(default=REASON_DRAIN, description="Why (shown by status).")

    @field_validator("reason")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        return _not_automatic(value)


class ReadmitRequest(_Request):
    """``POST /v1/instances/{id}/readmit``: back into the pool (no fields; body optional)."""


class PromoteRequest(_Request):
    """``POST /v1/instances/{id}/promote``: a warm standby joins its pool now (no fields)."""


class SuspectRequest(_Request):
    """``POST /v1/instances/{id}/suspect``: a sender could not connect to the instance.

    The control plane probes the instance itself and isolates it (reason ``unreachable``) only
    if its own probe fails at the connection level too: one confused sender cannot take a
    healthy replica out of the pool.
    """

    reason: Reason = Field(description="What the sender saw (connection refused, reset...).")
    reporter: Reporter | None = Field(
        default=None, description="Who reports (its address or instance id), for the logs."
    )


class ScalePolicyRequest(_Request):
    """``PUT /v1/pipelines/{p}/stages/{s}/scale``: the stage's autoscaling policy (the deploy
    config's ``autoscale:`` section). Idempotent; the launcher sends it at start and again
    whenever ``GET`` answers ``policy: null`` (Redis lost its data)."""

    autoscale: AutoscaleConfig = Field(description="The policy (deploy config `autoscale:`).")
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=MAX_REPLICAS,
        description="Starting desired count when no decision exists yet; default: ready count.",
    )


class WakeRequest(_Request):
    """``POST /v1/pipelines/{p}/stages/{s}/scale/wake``: requests wait for a stage that has no
    ready replica (scaled to zero). The policy asks for replicas at once, without windows."""

    waiting: int = Field(default=1, ge=1, le=1_000_000, description="Requests waiting for it.")


# ---- responses ---------------------------------------------------------------------------------


#: Version of the persisted scale decision layout (``ScaleDecision.schema_version``).
SCALE_SCHEMA_VERSION = 1


class ScaleDirection(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


class ScaleInputs(_Response):
    """The load figures of a stage's ready replicas that one decision was made from."""

    ready: int = Field(default=0, description="Healthy replicas in the pool.")
    in_flight: int = Field(default=0, description="Requests executing, summed over replicas.")
    queued: int = Field(default=0, description="Requests waiting in engines, summed.")
    capacity: int = Field(default=0, description="Concurrent requests the pool can run.")
    utilization: float = Field(default=0.0, description="Mean load per replica / its capacity.")
    step_ms: float | None = Field(default=None, description="Mean engine step time, ms.")
    kv_cache_usage: float | None = Field(default=None, description="Highest KV-cache use, 0..1.")
    latency_ms: float | None = Field(default=None, description="Estimated queue + step time, ms.")
    queue_wait_ms: float | None = Field(
        default=None, description="Mean queue wait the replicas reported, ms (mean over them)."
    )
    first_audio_p95_ms: float | None = Field(
        default=None,
        description="p95 time to first audio of the pipeline's API servers' last seconds, ms "
        "(read only for a pool that targets it; none below the least answers).",
    )
    first_audio_samples: int = Field(
        default=0, description="Answers in the API servers' first-audio windows, together."
    )
    realtime_factor_p5: float | None = Field(
        default=None,
        description="p5 real-time factor of the pipeline's API servers' last seconds (read "
        "only for a pool that targets it; none below the least answers).",
    )
    wake_waiting: int = Field(default=0, description="Requests waiting for a stage at zero.")
    standby: int = Field(default=0, description="Warm standby replicas (not in the pool).")


class ScaleDecision(_Response):
    """The last decision for a stage (persisted in Redis, served by every omni-cp)."""

    schema_version: int = SCALE_SCHEMA_VERSION
    desired: int = Field(description="Replicas the stage should have now.")
    previous: int = Field(description="Desired count before this decision.")
    recommended: int = Field(description="What the load alone asks for, within min/max.")
    direction: ScaleDirection
    reason: str = Field(description="Why: utilization, latency, wake, idle, cooldown, ...")
    decided_at_ms: int = Field(description="Redis server time of the decision.")
    changed_at_ms: int = Field(description="When the desired count last changed.")
    leader: str = Field(default="", description="Sweeper-lock token prefix of the decider.")
    inputs: ScaleInputs = Field(default_factory=ScaleInputs)
    history: tuple[tuple[int, int], ...] = Field(
        default=(), description="(time ms, recommended) change points within the windows."
    )


class ScaleStatus(_Response):
    """``GET /v1/pipelines/{p}/stages/{s}/scale[?pool=prefill]``: policy, desired and ready
    replicas of the stage's pool (or of a split stage's prefill pool)."""

    pipeline: str
    stage_id: int
    pool: ScalePool = Field(
        default=ScalePool.STAGE,
        description="stage: the stage's own pool (a split stage's decode pool); prefill: a "
        "split stage's prefill pool.",
    )
    policy: AutoscaleConfig | None = Field(default=None, description="null: not autoscaled.")
    desired: int | None = Field(default=None, description="null until the first decision.")
    ready: int = Field(default=0, description="Healthy replicas now.")
    decision: ScaleDecision | None = None


class Registration(_Response):
    """201 answer to a registration."""

    instance_id: str
    epoch: int
    lease_ttl_ms: int
    heartbeat_interval_ms: int


class HeartbeatAck(_Response):
    """200 answer to a heartbeat: what the control plane thinks of the instance now."""

    instance_id: str
    epoch: int
    state: InstanceState
    reason: str = ""


class ProbeOutcome(StrEnum):
    """How the control plane's own probe (``GET {address}/health``) of a suspect went."""

    ANSWERED = "answered"  # it answered HTTP, whatever the status: the process is alive
    REFUSED = "refused"  # connection refused: nothing listens there
    RESET = "reset"  # connection reset or closed without an answer
    TIMEOUT = "timeout"  # no answer within the probe's timeout
    UNREACHABLE = "unreachable"  # host unreachable
    ERROR = "error"  # something else (DNS, TLS...): inconclusive, nothing is done
    SKIPPED = "skipped"  # not probed: the instance is not healthy (already out of discovery)

    @property
    def dead(self) -> bool:
        """Whether the outcome says the process is gone (the instance is isolated)."""
        return self in _DEAD_OUTCOMES


_DEAD_OUTCOMES = frozenset(
    {ProbeOutcome.REFUSED, ProbeOutcome.RESET, ProbeOutcome.TIMEOUT, ProbeOutcome.UNREACHABLE}
)


class SuspectResult(_Response):
    """Answer to a suspect report: the probe's outcome and the instance's state after it."""

    instance_id: str
    isolated: bool = Field(description="The instance is isolated (out of discovery) now.")
    probe: ProbeOutcome
    detail: str = Field(default="", description="The probe's answer or error, for a person.")
    cached: bool = Field(
        default=False, description="The result of a concurrent or very recent probe, reused."
    )
    state: InstanceState
    reason: str = ""


class InstanceInfo(_Response):
    """One instance as discovery shows it."""

    instance_id: str
    pipeline: str
    stage_id: int
    address: str
    host_id: str
    capacity: int
    labels: dict[str, str] = Field(default_factory=dict)
    state: InstanceState
    reason: str = ""
    epoch: int
    registered_at_ms: int
    last_heartbeat_ms: int
    heartbeat_age_ms: int
    load: LoadReport = Field(default_factory=LoadReport)


class PoolSnapshot(_Response):
    """``GET /v1/pipelines/{p}/stages/{s}/instances``."""

    pipeline: str
    stage_id: int
    version: int
    instances: tuple[InstanceInfo, ...] = ()


class PipelineSnapshot(_Response):
    """One versioned snapshot of a pipeline's healthy pools (watch responses, SSE events)."""

    pipeline: str
    version: int
    stages: dict[int, tuple[InstanceInfo, ...]] = Field(default_factory=dict)

    def healthy(self, stage_id: int) -> tuple[InstanceInfo, ...]:
        return self.stages.get(stage_id, ())


class PipelineStatus(_Response):
    """A pipeline with every instance it has, whatever its state."""

    pipeline: str
    version: int
    instances: tuple[InstanceInfo, ...] = ()
    api_servers: tuple[InstanceInfo, ...] = Field(
        default=(), description="API servers running no stage (--api-only)."
    )
    desired: dict[int, int] = Field(
        default_factory=dict, description="Autoscaled stages: stage id -> desired replicas."
    )
    prefill_desired: dict[int, int] = Field(
        default_factory=dict,
        description="Split stages whose prefill pool autoscales: stage id -> its desired replicas.",
    )


class PipelineList(_Response):
    """``GET /v1/pipelines``: pipelines that have instances."""

    pipelines: tuple[PipelineStatus, ...] = ()


class HealthStatus(_Response):
    """``GET /healthz``."""

    status: str
    redis: bool


class ErrorDetail(_Response):
    """One error, as OpenAI (and every omni-mesh service) sends it."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None  # the field at fault, when one is
    code: int | str | None = None  # the HTTP status


class ErrorBody(_Response):
    """Body of every 4xx/5xx answer: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail
