"""Process settings, read once at the edge (CLI flags and ``OMNI_*`` environment variables).

Each settings class is a pydantic-settings model: every field is typed, defaulted, bounded and
described. Explicit keyword arguments (the CLI's flags) take precedence over the environment.
Nothing deeper in the code reads environment variables.

Environment names carry a per-component namespace below ``OMNI_`` (``OMNI_CP_PORT`` for the
control plane's port), so one environment can configure a control plane and a sidecar side by
side (``omni-up``) without one's ``PORT`` leaking into the other.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    UrlConstraints,
    field_validator,
    model_validator,
)
from pydantic_core import MultiHostUrl
from pydantic_settings import BaseSettings, SettingsConfigDict

#: ``redis+sentinel://h:p,h:p/service`` names a Sentinel-managed primary; ``redis+cluster`` is
#: accepted here only so that omni-cp can refuse it with one clear line (no Cluster support).
RedisUrl = Annotated[
    MultiHostUrl,
    UrlConstraints(
        allowed_schemes=[
            "redis",
            "rediss",
            "unix",
            "redis+sentinel",
            "rediss+sentinel",
            "redis+cluster",
            "rediss+cluster",
        ],
        host_required=False,
    ),
]


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


def check_host(text: str) -> str:
    """``text`` if it is a hostname (RFC 1123 labels) or an IP address; ValueError otherwise,
    so that a typo (``"bad host"``) fails at start instead of being retried forever."""
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        ipaddress.ip_address(bare)
    except ValueError:
        pass
    else:
        return text
    labels = bare.removesuffix(".").split(".")
    if 0 < len(bare) <= 253 and all(_HOST_LABEL.match(label) for label in labels):
        return text
    raise ValueError(f"{text!r} is not a hostname or IP address")


class LogLevel(StrEnum):
    """Log levels accepted by ``--log-level`` (case-insensitive)."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:
        if isinstance(value, str):
            return cls.__members__.get(value.upper())
        return None

    @property
    def as_int(self) -> int:
        return logging.getLevelNamesMapping()[self.value]


class ControlPlaneSettings(BaseSettings):
    """Settings of one ``omni-cp serve`` process (env prefix ``OMNI_CP_``)."""

    model_config = SettingsConfigDict(
        env_prefix="OMNI_CP_", extra="forbid", frozen=True, validate_default=True
    )

    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        max_length=255,
        description="Interface the HTTP API listens on.",
    )
    port: int = Field(default=7700, ge=1, le=65535, description="TCP port of the HTTP API.")
    redis_url: RedisUrl | None = Field(
        default=None,
        description="Redis holding all state (redis://, rediss://, unix://, "
        "redis+sentinel://h:p,h:p/service); none starts an embedded redis-server child.",
    )
    auth_token: SecretStr | None = Field(
        default=None,
        description="Bearer token required on every route but /healthz and /metrics.",
    )
    heartbeat_interval_ms: int = Field(
        default=1000, ge=50, le=60_000, description="How often instances should heartbeat."
    )
    lease_ttl_ms: int = Field(
        default=3000,
        ge=100,
        le=600_000,
        description="An instance whose last heartbeat is older than this is isolated.",
    )
    sweep_interval_ms: int = Field(
        default=250, ge=10, le=10_000, description="Period of the liveness sweeper."
    )
    sweeper_lock_ttl_ms: int = Field(
        default=2000,
        ge=100,
        le=60_000,
        description="Expiry of the sweeper lock: how soon another omni-cp takes over the sweeper.",
    )
    evict_after_ms: int = Field(
        default=60_000,
        ge=0,
        le=86_400_000,
        description="Records of instances isolated by lease expiry are deleted after this.",
    )
    watch_max_timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="Upper bound of a watch request's timeout_s."
    )
    log_level: LogLevel = Field(default=LogLevel.INFO, description="Log level of the process.")

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        return check_host(value)

    @field_validator("auth_token")
    @classmethod
    def _token_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("must not be empty (leave it unset to disable auth)")
        return value

    @model_validator(mode="after")
    def _check_timings(self) -> ControlPlaneSettings:
        if self.lease_ttl_ms <= self.heartbeat_interval_ms:
            raise ValueError(
                f"lease_ttl_ms ({self.lease_ttl_ms}) must be greater than "
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms})"
            )
        if self.sweeper_lock_ttl_ms <= self.sweep_interval_ms:
            raise ValueError(
                f"sweeper_lock_ttl_ms ({self.sweeper_lock_ttl_ms}) must be greater than "
                f"sweep_interval_ms ({self.sweep_interval_ms})"
            )
        return self

    @property
    def redis_url_str(self) -> str | None:
        return None if self.redis_url is None else str(self.redis_url)

    @property
    def token(self) -> str | None:
        return None if self.auth_token is None else self.auth_token.get_secret_value()


class ControlPlaneClientSettings(BaseSettings):
    """Where ``omni-cp status`` (and other control-plane clients) find the control plane."""

    model_config = SettingsConfigDict(
        env_prefix="OMNI_CP_", extra="ignore", frozen=True, validate_default=True
    )

    url: str = Field(
        default="http://127.0.0.1:7700",
        min_length=1,
        max_length=2048,
        description="Base URL(s) of omni-cp, comma-separated; tried in order.",
    )
    auth_token: SecretStr | None = Field(
        default=None, description="Bearer token sent to the control plane."
    )
    timeout_s: float = Field(
        default=2.0, gt=0, le=120, description="Timeout of one control-plane request."
    )

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(u.strip() for u in self.url.split(",") if u.strip())

    @property
    def token(self) -> str | None:
        return None if self.auth_token is None else self.auth_token.get_secret_value()


class UpSettings(BaseSettings):
    """Settings of one ``omni-up`` run (env prefix ``OMNI_UP_``; the secret ``OMNI_SECRET``)."""

    model_config = SettingsConfigDict(env_prefix="OMNI_UP_", extra="forbid", frozen=True)

    pipeline: str = Field(min_length=1, max_length=48, description="Registered pipeline name.")
    replicas: str | None = Field(
        default=None,
        max_length=512,
        description="Replicas per stage, e.g. 1:2:1 (a flag: --stage-overrides num_replicas wins).",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="API server port.")
    host: str = Field(default="127.0.0.1", description="API server interface.")
    deploy_config: Path | None = Field(
        default=None, description="Deploy YAML for every stage (default: bundled)."
    )
    secret: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("secret", "OMNI_SECRET"),
        description="Deployment secret (default: generated for this run).",
    )
    cp_port: int | None = Field(
        default=None, ge=1, le=65535, description="Control plane port (default: a free one)."
    )
    stage_overrides: str | None = Field(
        default=None, description='Per-stage deploy JSON, e.g. {"1": {"max_num_seqs": 4}}.'
    )
    async_chunk: bool | None = Field(
        default=None, description="Stream chunks between stages (default: the deploy config's)."
    )
    keep_logs: bool = Field(default=False, description="Keep the process logs on exit.")
    ready_timeout_s: float = Field(
        default=180.0, gt=0, le=3600, description="Seconds per start phase."
    )
    drain_timeout_s: float = Field(
        default=30.0, ge=0, le=3600, description="How long each pod finishes in-flight work."
    )
    stop_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=7200,
        description="SIGTERM to SIGKILL per stop group (default: drain timeout + 10 s).",
    )
    log_level: LogLevel = Field(default=LogLevel.INFO, description="Log level.")

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        return check_host(value)

    @model_validator(mode="after")
    def _check_ports(self) -> UpSettings:
        if self.cp_port is not None and self.cp_port == self.port:
            raise ValueError(f"--cp-port and --port are both {self.port}")
        return self
