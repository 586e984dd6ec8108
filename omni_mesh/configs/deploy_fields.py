"""Field types and limits of the deploy config schema (:mod:`omni_mesh.configs.deploy`): names,
device lists, connector edge keys, bounds, and which keys are pipeline-wide."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
)

__all__ = [
    "DEFAULT_CONNECTOR",
    "MAX_DEVICES",
    "MAX_LATENCY_MS",
    "MAX_OUTPUT_BYTES",
    "MAX_PARALLEL",
    "MAX_REPLICAS",
    "PIPELINE_ONLY_KEYS",
    "STAGE_DEFAULT_KEYS",
    "ApiRoute",
    "ConnectorClass",
    "DeviceList",
    "Dtype",
    "ExecutorBackend",
    "ExtraValue",
    "InputKey",
    "OutputKey",
    "PipelineRef",
    "PlatformName",
    "PriorityClass",
    "RefName",
    "StageSampling",
    "edge_stage",
]

ConnectorClass = Literal["SharedMemoryConnector", "HttpConnector"]
DEFAULT_CONNECTOR: ConnectorClass = "SharedMemoryConnector"
Dtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
ExecutorBackend = Literal["uni", "mp", "ray", "external_launcher"]
ExtraValue = str | int | float | bool
#: Admission classes of a request (X-Omni-Priority), served high first.
PriorityClass = Literal["high", "normal", "low"]
#: A client route whose accepted priority classes may be capped (``priority_classes``).
ApiRoute = Literal[
    "/v1/generate",
    "/v1/audio/speech",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/images/generations",
    "/v1/run",
]

_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_\-]{0,31}$"
RefName = Annotated[str, StringConstraints(pattern=_NAME_PATTERN)]
PlatformName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,15}$")]
PipelineRef = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9\-]{0,47}$")]

MAX_REPLICAS = 256
MAX_PARALLEL = 1024
MAX_LATENCY_MS = 60_000.0
MAX_OUTPUT_BYTES = 1 << 30
MAX_DEVICES = 4096

# Keys that only make sense for the whole pipeline; inside a stage they are an error, not an
# engine extra (seed doc: pipeline-wide settings are declared at the top level).
PIPELINE_ONLY_KEYS = frozenset(
    {
        "pipeline",
        "trust_remote_code",
        "distributed_executor_backend",
        "async_chunk",
        "request_timeout_s",
        "hop_retries",
        "priority_classes",
        "connectors",
        "stages",
        "platforms",
        "base_config",
    }
)
# Pipeline-wide settings applied to every stage that does not set its own.
STAGE_DEFAULT_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "dtype",
)


def _coerce_devices(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # YAML `devices: 0`
    if isinstance(value, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return ",".join(str(v) for v in value)
    if isinstance(value, str):
        return value.replace(" ", "")
    return value


def _check_devices(value: str) -> str:
    if not re.fullmatch(r"[0-9]{1,5}(,[0-9]{1,5})*", value):
        raise ValueError("devices must be comma-separated device indices, such as '0,1,2,3'")
    ids = [int(v) for v in value.split(",")]
    if len(ids) > MAX_DEVICES:
        raise ValueError(f"at most {MAX_DEVICES} devices")
    if len(set(ids)) != len(ids):
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"device(s) {dupes} listed more than once")
    return ",".join(str(i) for i in ids)


DeviceList = Annotated[str, BeforeValidator(_coerce_devices), AfterValidator(_check_devices)]


def _edge_key_checker(prefix: str, what: str) -> AfterValidator:
    def check(key: str) -> str:
        if not re.fullmatch(rf"{prefix}[0-9]{{1,2}}", key):
            raise ValueError(f"keys are '{prefix}N' where N is the {what} stage id, got {key!r}")
        return key

    return AfterValidator(check)


InputKey = Annotated[str, _edge_key_checker("from_stage_", "source")]
OutputKey = Annotated[str, _edge_key_checker("to_stage_", "receiving")]


def edge_stage(key: str) -> int:
    """The stage id in a ``from_stage_N`` / ``to_stage_N`` key."""
    return int(key.rsplit("_", 1)[1])


class StageSampling(BaseModel):
    """A stage's default sampling (vLLM stages): a request's own sampling params win, field by
    field; unset fields fall back to vLLM's defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float | None = Field(default=None, ge=0.0, le=10.0, description="Temperature.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, ge=0, le=1_000_000, description="Top-k; 0 = off.")
    max_tokens: int | None = Field(
        default=None, ge=1, le=65536, description="Tokens generated per request."
    )
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, le=10.0, description="Penalty on repeated tokens; 1 = off."
    )
    stop: tuple[str, ...] = Field(
        default=(), max_length=16, description="Stop strings (not part of the output)."
    )
