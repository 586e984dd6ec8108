"""Settings of one stage pod (``omni-stage``), read once at the edge from flags and
``OMNI_STAGE_*`` environment variables (the deployment secret also from ``OMNI_SECRET``).

Every field has one flag and one variable (:data:`STAGE_FLAGS`); a flag given on the command
line beats the variable, which beats the default. The deploy settings (``--max-num-seqs`` and
the like) are not here: they are layers of the deploy config (:mod:`omni_mesh.configs.loader`).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from omni_mesh.configs.settings import check_host
from omni_mesh.configs.settings_flags import flag_specs

DEFAULT_CP_PORT = 7700


class StageSettings(BaseSettings):
    """One stage pod: which stage it is, where it listens, how it finds the control plane."""

    model_config = SettingsConfigDict(env_prefix="OMNI_STAGE_", extra="forbid", frozen=True)

    pipeline: str = Field(min_length=1, max_length=48, description="Registered pipeline name.")
    stage_id: int = Field(default=0, ge=0, lt=64, description="Stage this pod runs.")
    headless: bool = Field(default=False, description="Serve no client API (hop and /v1/run only).")
    api_only: bool = Field(
        default=False, description="Serve the client API with no engine; route into stage-0 pool."
    )
    standby: bool = Field(
        default=False,
        description="Register as a warm standby: loaded and heartbeating, never routed to until "
        "the autoscaler promotes it (omni-up starts these for standby_replicas).",
    )
    role: Literal["both", "prefill", "decode"] = Field(
        default="both",
        description="A split stage's pool (deploy prefill:): prefill or decode; both = unsplit.",
    )
    replica_index: int = Field(
        default=0,
        ge=0,
        lt=4096,
        description="This pod's replica slot in its stage's pool: its slice of the stage's "
        "devices (omni-up numbers its replicas; one pod per GPU set: 0).",
    )
    control_plane: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Control plane base URLs, repeated or comma-separated (several: failover).",
    )
    omni_master_address: str | None = Field(
        default=None, description="Control plane host (the seeds' form; adds http://HOST:PORT)."
    )
    omni_master_port: int | None = Field(
        default=None, ge=1, le=65535, description="Control plane port with --omni-master-address."
    )
    cp_auth_token: SecretStr | None = Field(default=None, description="Control plane bearer token.")
    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8000, ge=1, le=65535, description="TCP port to listen on.")
    advertise_address: str | None = Field(
        default=None,
        description="URL or host other pods use to reach this one (default http://host:port).",
    )
    host_id: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=128,
        description="Identity of the machine, for same-host (shm) hand-offs.",
    )
    secret: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("secret", "OMNI_SECRET"),
        description="Deployment secret that HMAC-tags /v1/run stage inputs.",
    )
    deploy_config: Path | None = Field(default=None, description="Deploy YAML (default: bundled).")
    platform: str | None = Field(
        default=None, max_length=32, description="Platform section of the deploy YAML to apply."
    )
    stage_overrides: str | None = Field(
        default=None,
        description='Per-stage deploy JSON, the highest layer, e.g. {"1": {"max_num_seqs": 4}}.',
    )
    engine_threads: int = Field(default=1, ge=1, le=256, description="torch threads in the engine.")
    engine_start_timeout_s: float = Field(
        default=300.0, gt=0, le=3600, description="READY timeout."
    )
    api_max_inflight: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Requests an engine-less API server runs at once; more wait in its queue. "
        "Default: twice the entry stage's pool capacity (max_inflight x replicas), at least 64.",
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, le=3600, description="SIGTERM drain bound.")
    max_body_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024, le=1 << 34, description="Largest accepted HTTP body."
    )
    realtime_max_sessions: int = Field(
        default=1000,
        ge=0,
        le=1_000_000,
        description="Realtime WebSocket sessions an API server holds at once; one more is "
        "refused with 503 (0: no /v1/realtime).",
    )
    realtime_send_queue_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=64 * 1024,
        le=1 << 30,
        description="Server events a realtime session queues for a slow client before it is "
        "told (error slow_consumer) and disconnected.",
    )
    realtime_session_ttl_s: float = Field(
        default=600.0,
        ge=1,
        le=7 * 24 * 3600,
        description="How long the control plane keeps a realtime session after its socket "
        "closed (a client reconnects with ?session_id= to continue it).",
    )
    hop_connect_timeout_s: float = Field(
        default=0.3,
        gt=0,
        le=30,
        description="Connect timeout of a hop's connection (never past the request's deadline).",
    )
    hop_probe_after_s: float = Field(
        default=0.5,
        ge=0.05,
        le=60,
        description="A replica with a hop unanswered this long gets a GET /health probe.",
    )
    hop_probe_interval_s: float = Field(
        default=0.5,
        ge=0.05,
        le=60,
        description="Re-probe period of a replica while hops to it stay unanswered.",
    )
    hop_probe_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=30,
        description="A connected probe's answer bound; a failed probe replays the replica's hops.",
    )
    hop_keepalive_s: int = Field(
        default=5,
        ge=0,
        le=600,
        description="TCP keepalive: an idle hop connection whose peer went silent is closed "
        "after about this long; 0 keeps the kernel's defaults.",
    )
    gc_busy_pass_s: float = Field(
        default=60.0,
        ge=0,
        le=3600,
        description="Full garbage-collector passes run when the pod is idle, or after this "
        "long busy (their survivors then frozen until the next idle moment); 0 leaves them to "
        "CPython's automatic thresholds.",
    )
    gc_young_pass_s: float = Field(
        default=0.1,
        ge=0,
        le=60,
        description="While the pod holds work, a young garbage-collector pass this often (a "
        "tenth of a second's new objects, not the seconds' worth CPython's thresholds let "
        "queued requests pile up); 0 leaves young passes to CPython, as gc_busy_pass_s 0 does.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Logging level."
    )
    tracing: Literal["none", "console", "otlp"] = Field(
        default="none", description="OpenTelemetry span exporter (otlp reads OTEL_* env vars)."
    )

    @model_validator(mode="before")
    @classmethod
    def _master_address(cls, data: Any) -> Any:
        """``-oma HOST [-omp PORT]`` (the seeds' form) adds ``http://HOST:PORT`` to
        ``control_plane``; a bad host is left to its own field's check."""
        if not isinstance(data, dict) or not data.get("omni_master_address"):
            return data
        host = str(data["omni_master_address"])
        try:
            check_host(host)
        except ValueError:
            return data
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        port = data.get("omni_master_port") or DEFAULT_CP_PORT
        urls = split_urls(data.get("control_plane", ()))
        return {**data, "control_plane": (*urls, f"http://{host}:{port}")}

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("control_plane", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        return split_urls(value)

    @field_validator("control_plane")
    @classmethod
    def _check_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            check_http_url(url)
        return value

    @field_validator("host", "omni_master_address")
    @classmethod
    def _check_host(cls, value: str | None) -> str | None:
        return None if value is None else check_host(value)

    @field_validator("advertise_address")
    @classmethod
    def _check_advertise(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if "://" in value:
            check_http_url(value, need_port=False)
        else:
            check_host(value)
        return value.rstrip("/")

    @model_validator(mode="after")
    def _check(self) -> StageSettings:
        if self.headless and self.api_only:
            raise ValueError("--headless and --api-only exclude each other")
        if self.omni_master_port is not None and self.omni_master_address is None:
            raise ValueError("--omni-master-port needs --omni-master-address")
        return self

    @property
    def address(self) -> str:
        """The URL other pods reach this one at (``-ora HOST`` means http://HOST:port)."""
        adv = self.advertise_address
        if adv and "://" in adv:
            return adv
        host = adv or ("127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def secret_bytes(self) -> bytes:
        if self.secret is None:
            raise ValueError("no deployment secret: pass --secret or set OMNI_SECRET")
        return self.secret.get_secret_value().encode()


def check_http_url(url: str, *, need_port: bool = True) -> str:
    """``url`` if it is ``http(s)://HOST[:PORT]`` with a valid host; ValueError otherwise."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
        need_port = True
    if parts.scheme not in ("http", "https") or not parts.hostname or (need_port and port is None):
        raise ValueError(f"{url!r} is not an http(s)://host:port URL")
    check_host(parts.hostname)
    return url


#: ``omni-stage``'s flags: one per field, the seeds' short forms as aliases.
STAGE_FLAGS = flag_specs(
    StageSettings,
    aliases={
        "omni_master_address": ("-oma",),
        "omni_master_port": ("-omp",),
        "advertise_address": ("--omni-replica-address", "-ora"),
        "engine_start_timeout_s": ("--engine-start-timeout",),
        "drain_timeout_s": ("--drain-timeout",),
    },
)


def split_urls(value: Any) -> Any:
    """URLs given repeatedly and/or comma-separated, as one tuple (other values unchanged)."""
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, tuple | list):
        parts = (u.strip() for v in value for u in str(v).split(","))
        return tuple(u.rstrip("/") for u in parts if u)
    return value
