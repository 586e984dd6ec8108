"""Settings of one stage pod (``omni-stage``), read once at the edge from flags and
``OMNI_STAGE_*`` environment variables (the deployment secret also from ``OMNI_SECRET``)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class StageSettings(BaseSettings):
    """One stage pod: which stage it is, where it listens, how it finds the control plane."""

    model_config = SettingsConfigDict(env_prefix="OMNI_STAGE_", extra="forbid", frozen=True)

    pipeline: str = Field(min_length=1, max_length=48, description="Registered pipeline name.")
    stage_id: int = Field(default=0, ge=0, lt=64, description="Stage this pod runs.")
    headless: bool = Field(default=False, description="Serve no client API (hop and /v1/run only).")
    api_only: bool = Field(
        default=False, description="Serve the client API with no engine; route into stage-0 pool."
    )
    control_plane: tuple[str, ...] = Field(
        default=(), description="Control plane base URLs (several: failover)."
    )
    cp_auth_token: SecretStr | None = Field(default=None, description="Control plane bearer token.")
    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8000, ge=1, le=65535, description="TCP port to listen on.")
    advertise_address: str | None = Field(
        default=None, description="URL other pods use to reach this one (default http://host:port)."
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
    engine_threads: int = Field(default=1, ge=1, le=256, description="torch threads in the engine.")
    engine_start_timeout_s: float = Field(
        default=300.0, gt=0, le=3600, description="READY timeout."
    )
    api_max_inflight: int = Field(
        default=4096,
        ge=1,
        le=1_000_000,
        description="Requests an engine-less API server admits at once before answering 429.",
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, le=3600, description="SIGTERM drain bound.")
    max_body_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024, le=1 << 34, description="Largest accepted HTTP body."
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
        default=1.0,
        gt=0,
        le=30,
        description="A connected probe's answer bound; a failed probe replays the replica's hops.",
    )
    hop_keepalive_s: int = Field(
        default=5,
        ge=0,
        le=600,
        description="Kernel bound on a hop connection whose peer went silent (TCP keepalive and "
        "TCP_USER_TIMEOUT); 0 keeps the kernel's defaults.",
    )
    log_level: str = Field(default="INFO", description="Logging level.")
    tracing: Literal["none", "console", "otlp"] = Field(
        default="none", description="OpenTelemetry span exporter (otlp reads OTEL_* env vars)."
    )

    @model_validator(mode="after")
    def _check(self) -> StageSettings:
        if self.headless and self.api_only:
            raise ValueError("--headless and --api-only exclude each other")
        return self

    @property
    def address(self) -> str:
        if self.advertise_address:
            return self.advertise_address.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def secret_bytes(self) -> bytes:
        if self.secret is None:
            raise ValueError("no deployment secret: pass --secret or set OMNI_SECRET")
        return self.secret.get_secret_value().encode()
