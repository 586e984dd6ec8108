"""Deploy configuration schema: how each stage of a pipeline runs.

A deploy config says how many replicas a stage has, which devices they use, how large their
batches are, which connector carries each edge of the pipeline's DAG and which engine knobs they
get. The topology itself is a :class:`~omni_mesh.configs.pipeline.PipelineSpec` (Python, never
YAML). YAML files, platform sections and command-line overrides are merged into these models by
:mod:`omni_mesh.configs.loader`; nothing else reads raw deploy dicts.

Field types and limits live in :mod:`~omni_mesh.configs.deploy_fields`, cross-field checks in
:mod:`~omni_mesh.configs.deploy_checks` and the error types in :mod:`~omni_mesh.configs.errors`;
their public names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.deploy_checks import config_problems, disagreement, duplicate_ids
from omni_mesh.configs.deploy_fields import (
    DEFAULT_CONNECTOR,
    MAX_DEVICES,
    MAX_LATENCY_MS,
    MAX_OUTPUT_BYTES,
    MAX_PARALLEL,
    MAX_REPLICAS,
    PIPELINE_ONLY_KEYS,
    STAGE_DEFAULT_KEYS,
    ApiRoute,
    ConnectorClass,
    DeviceList,
    Dtype,
    ExecutorBackend,
    ExtraValue,
    InputKey,
    OutputKey,
    PipelineRef,
    PlatformName,
    PriorityClass,
    RefName,
    StageSampling,
    edge_stage,
)
from omni_mesh.configs.errors import ConfigIssue, DeployConfigError
from omni_mesh.configs.pipeline import MAX_STAGES, PipelineSpec

__all__ = [
    "DEFAULT_CONNECTOR",
    "MAX_DEVICES",
    "MAX_LATENCY_MS",
    "MAX_OUTPUT_BYTES",
    "MAX_PARALLEL",
    "MAX_REPLICAS",
    "PIPELINE_ONLY_KEYS",
    "STAGE_DEFAULT_KEYS",
    "AutoscaleConfig",
    "ConfigIssue",
    "ConnectorClass",
    "ConnectorSpec",
    "DeployConfig",
    "DeployConfigError",
    "DeviceList",
    "Dtype",
    "ExecutorBackend",
    "ExtraValue",
    "InputKey",
    "OutputKey",
    "PipelineRef",
    "PlatformName",
    "PlatformSection",
    "RefName",
    "StageDeployConfig",
    "check_stage_keys",
    "edge_stage",
]


# ---- models ---------------------------------------------------------------------------------


class ConnectorSpec(BaseModel):
    """A named connector under ``connectors:``: the class that carries an edge's payloads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ConnectorClass = Field(description="Connector class that carries the edge's payloads.")
    extra: dict[str, ExtraValue] = Field(
        default_factory=dict,
        max_length=64,
        description=(
            "Connector options, checked when a pod starts (the built-in connectors take none)."
        ),
    )


def check_stage_keys(data: Mapping[Any, Any]) -> dict[Any, Any]:
    """Refuse pipeline-wide settings inside a stage entry. Any other key that is not a stage
    field is refused by the model (``extra="forbid"``): free-form engine keys go under an
    explicit ``engine_extras:`` block (vLLM's arguments under ``engine_args:``)."""
    misplaced = sorted(str(k) for k in data if k in PIPELINE_ONLY_KEYS)
    if misplaced:
        raise ValueError(
            f"{', '.join(misplaced)}: pipeline-wide setting(s); set them at the top level of "
            "the deploy config, not inside a stage"
        )
    return dict(data)


class StageDeployConfig(BaseModel):
    """How one stage runs: replicas, devices, batch sizes, connectors and engine knobs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage_id: int = Field(ge=0, lt=MAX_STAGES, description="Pipeline stage this entry configures.")
    num_replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description="Replicas in this stage's pool (0 only with autoscale.min_replicas 0).",
    )
    devices: DeviceList | None = Field(
        default=None,
        description="Device indices for the whole pool, e.g. '0,1,2,3'; null = CPU, no accounting.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=MAX_PARALLEL, description="Tensor-parallel ranks per replica."
    )
    pipeline_parallel_size: int = Field(
        default=1, ge=1, le=MAX_PARALLEL, description="Pipeline-parallel ranks per replica."
    )
    data_parallel_size: int = Field(
        default=1, ge=1, le=MAX_PARALLEL, description="Data-parallel ranks (global)."
    )
    data_parallel_size_local: int | None = Field(
        default=None,
        ge=1,
        le=MAX_PARALLEL,
        description="Data-parallel ranks on this node; null = data_parallel_size.",
    )
    max_num_seqs: int = Field(
        default=8, ge=1, le=4096, description="Most requests the engine batches in one step."
    )
    max_inflight: int = Field(
        default=64,
        ge=1,
        le=65536,
        description="Requests a replica's sidecar runs at once; more wait in its admission queue.",
    )
    max_queue: int = Field(
        default=1024,
        ge=0,
        le=1_000_000,
        description="Requests that may wait for a slot (admission queue); more are shed (503).",
    )
    max_queue_wait_s: float = Field(
        default=30.0,
        gt=0.0,
        le=3600.0,
        description="Longest wait in the admission queue before a request is shed (503).",
    )
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Fraction of device memory the engine may use."
    )
    max_model_len: int | None = Field(
        default=None, ge=1, le=1 << 24, description="Longest sequence (prompt + output) in tokens."
    )
    enforce_eager: bool | None = Field(
        default=None, description="Disable graph capture and run eagerly."
    )
    dtype: Dtype | None = Field(default=None, description="Weight and activation dtype.")
    input_connectors: dict[InputKey, RefName] = Field(
        default_factory=dict,
        max_length=MAX_STAGES,
        description="Connector per incoming edge, keyed 'from_stage_N'.",
    )
    output_connectors: dict[OutputKey, RefName] = Field(
        default_factory=dict,
        max_length=MAX_STAGES,
        description="Connector per outgoing edge, keyed 'to_stage_N'.",
    )
    step_latency_ms: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_LATENCY_MS,
        description="Synthetic engine: fixed time per step (a in a + b*batch ms).",
    )
    per_item_latency_ms: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_LATENCY_MS,
        description="Synthetic engine: time per batched item (b in a + b*batch ms).",
    )
    output_bytes: int = Field(
        default=64,
        ge=0,
        le=MAX_OUTPUT_BYTES,
        description="Synthetic engine: payload bytes each request outputs.",
    )
    output_chunks: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Synthetic engine: chunks a whole input's output is streamed in (async_chunk).",
    )
    autoscale: AutoscaleConfig | None = Field(
        default=None,
        description="Per-stage autoscaling policy; num_replicas is then the starting count.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        max_length=256,
        description="vLLM stages: engine arguments for vLLM (model, seed, …), checked at start.",
    )
    sampling: StageSampling = Field(
        default_factory=StageSampling,
        description="vLLM stages: default sampling; a request's own sampling params win.",
    )
    engine_extras: dict[str, Any] = Field(
        default_factory=dict,
        max_length=256,
        description="Free-form engine knobs, forwarded to the engine unchanged.",
    )

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        return check_stage_keys(data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _check_autoscale(self, info: ValidationInfo) -> Self:
        scale = self.autoscale
        if _context(info, "layer"):
            return self
        if scale is None:
            if self.num_replicas == 0:
                raise ValueError(
                    f"num_replicas is 0 but stage {self.stage_id} has no autoscale policy: a "
                    "stage starts at 0 replicas only when autoscale.min_replicas is 0 (the "
                    "first request wakes it); give it at least 1 replica"
                )
            return self
        if not scale.min_replicas <= self.num_replicas <= scale.max_replicas:
            raise ValueError(
                f"num_replicas ({self.num_replicas}) is the starting count of an autoscaled "
                f"stage and must lie in [autoscale.min_replicas, autoscale.max_replicas] = "
                f"[{scale.min_replicas}, {scale.max_replicas}]"
            )
        return self

    @property
    def max_pool_size(self) -> int:
        """The most replicas the pool may have: ``autoscale.max_replicas``, else num_replicas."""
        return self.autoscale.max_replicas if self.autoscale else self.num_replicas

    @property
    def world_size(self) -> int:
        """Devices one replica uses: tp x (local dp, else dp) x pp."""
        dp = self.data_parallel_size_local or self.data_parallel_size
        return self.tensor_parallel_size * dp * self.pipeline_parallel_size

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.devices.split(",")) if self.devices else ()

    def replica_devices(self, replica: int) -> tuple[int, ...]:
        """The slice of ``devices`` that replica ``replica`` (0-based) runs on; () on CPU."""
        if not 0 <= replica < self.max_pool_size:
            raise ValueError(f"stage {self.stage_id} has no replica {replica}")
        ws = self.world_size
        return self.device_ids[replica * ws : (replica + 1) * ws]

    def input_connector(self, from_stage: int) -> str | None:
        return self.input_connectors.get(f"from_stage_{from_stage}")

    def output_connector(self, to_stage: int) -> str | None:
        return self.output_connectors.get(f"to_stage_{to_stage}")


class PlatformSection(BaseModel):
    """Overrides under ``platforms.<name>``, applied when running on that platform."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trust_remote_code: bool | None = Field(default=None, description="Overrides trust_remote_code.")
    dtype: Dtype | None = Field(default=None, description="Overrides the pipeline-wide dtype.")
    distributed_executor_backend: ExecutorBackend | None = Field(
        default=None, description="Overrides distributed_executor_backend."
    )
    tensor_parallel_size: int | None = Field(
        default=None, ge=1, le=MAX_PARALLEL, description="Overrides tensor_parallel_size."
    )
    pipeline_parallel_size: int | None = Field(
        default=None, ge=1, le=MAX_PARALLEL, description="Overrides pipeline_parallel_size."
    )
    data_parallel_size: int | None = Field(
        default=None, ge=1, le=MAX_PARALLEL, description="Overrides data_parallel_size."
    )
    async_chunk: bool | None = Field(default=None, description="Overrides async_chunk.")
    request_timeout_s: float | None = Field(
        default=None, ge=0.1, le=3600.0, description="Overrides request_timeout_s."
    )
    hop_retries: int | None = Field(default=None, ge=0, le=10, description="Overrides hop_retries.")
    stages: list[StageDeployConfig] = Field(
        default_factory=list,
        max_length=MAX_STAGES,
        description="Stage entries merged by stage_id onto the base stages.",
    )

    @model_validator(mode="after")
    def _check_local(self) -> Self:
        _raise_if(duplicate_ids(self.stages, "stages"))
        return self


class DeployConfig(BaseModel):
    """How a whole pipeline is deployed: pipeline-wide settings, connectors and stages."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pipeline: PipelineRef | None = Field(
        default=None, description="Pipeline this config is for; null = any (set by the loader)."
    )
    trust_remote_code: bool = Field(
        default=False, description="Allow model repositories to run their own code."
    )
    dtype: Dtype | None = Field(
        default=None, description="Dtype for every stage that does not set its own."
    )
    distributed_executor_backend: ExecutorBackend | None = Field(
        default=None, description="How multi-device engines start their workers; null = auto."
    )
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_PARALLEL,
        description="Tensor-parallel size for every stage that does not set its own.",
    )
    pipeline_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_PARALLEL,
        description="Pipeline-parallel size for every stage that does not set its own.",
    )
    data_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_PARALLEL,
        description="Data-parallel size for every stage that does not set its own.",
    )
    async_chunk: bool = Field(
        default=False, description="Stream stage outputs to the next stage in chunks."
    )
    request_timeout_s: float = Field(
        default=120.0, ge=0.1, le=3600.0, description="Default deadline of a request, seconds."
    )
    hop_retries: int = Field(
        default=2, ge=0, le=10, description="Replays of a failed hand-off on another replica."
    )
    priority_classes: dict[ApiRoute, list[PriorityClass]] = Field(
        default_factory=dict,
        max_length=16,
        description="Priority classes a client route accepts, e.g. {/v1/audio/speech: "
        "[normal, low]}; a route not listed accepts all.",
    )
    connectors: dict[RefName, ConnectorSpec] = Field(
        default_factory=dict, max_length=64, description="Named connectors stages refer to."
    )
    stages: list[StageDeployConfig] = Field(
        default_factory=list,
        max_length=MAX_STAGES,
        description="Per-stage settings, merged by stage_id; absent stages get defaults.",
    )
    platforms: dict[PlatformName, PlatformSection] = Field(
        default_factory=dict,
        max_length=16,
        description="Per-platform overrides (e.g. cuda, npu), applied when selected.",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_stage_defaults(cls, data: Any, info: ValidationInfo) -> Any:
        if _context(info, "layer") or not isinstance(data, Mapping):
            return data
        defaults = {k: data[k] for k in STAGE_DEFAULT_KEYS if data.get(k) is not None}
        stages = data.get("stages")
        if not defaults or not isinstance(stages, list):
            return data
        return {**data, "stages": [_with_defaults(s, defaults) for s in stages]}

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Self:
        if _context(info, "layer") or _context(info, "defer_checks"):
            _raise_if(duplicate_ids(self.stages, "stages"))
            return self
        _raise_if(self.problems())
        return self

    # ---- lookups ---------------------------------------------------------------------------

    def stage(self, stage_id: int) -> StageDeployConfig:
        """The settings of ``stage_id``; a stage absent from the config gets the defaults."""
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        defaults = {k: getattr(self, k) for k in STAGE_DEFAULT_KEYS if getattr(self, k) is not None}
        return StageDeployConfig.model_validate({**defaults, "stage_id": stage_id})

    def connector_name_for_edge(self, from_stage: int, to_stage: int) -> str | None:
        """The connector named for an edge by its sender or receiver; None when neither does."""
        out = self.stage(from_stage).output_connector(to_stage)
        inp = self.stage(to_stage).input_connector(from_stage)
        if out and inp and out != inp:
            raise DeployConfigError(disagreement(from_stage, to_stage, out, inp))
        return out or inp

    def connector_for_edge(self, from_stage: int, to_stage: int) -> ConnectorSpec:
        """The connector carrying ``from_stage -> to_stage`` (SharedMemoryConnector if unnamed)."""
        name = self.connector_name_for_edge(from_stage, to_stage)
        if name is None:
            return ConnectorSpec(name=DEFAULT_CONNECTOR)
        try:
            return self.connectors[name]
        except KeyError:
            raise DeployConfigError(
                ConfigIssue("connectors", f"connector {name!r} is not defined", from_stage)
            ) from None

    # ---- validation ------------------------------------------------------------------------

    def problems(self, pipeline: PipelineSpec | None = None) -> list[ConfigIssue]:
        """Cross-field problems: connectors, edges, device counts, and (given the pipeline)
        stage ids and edges that are not in its DAG. Empty when the config is consistent."""
        return config_problems(self, pipeline)


# ---- helpers --------------------------------------------------------------------------------


def _context(info: ValidationInfo, key: str) -> bool:
    return isinstance(info.context, Mapping) and bool(info.context.get(key))


def _raise_if(issues: list[ConfigIssue]) -> None:
    if issues:
        raise ValueError("; ".join(str(i) for i in issues))


def _with_defaults(stage: object, defaults: Mapping[str, Any]) -> object:
    if isinstance(stage, StageDeployConfig):
        missing = {k: v for k, v in defaults.items() if k not in stage.model_fields_set}
        return stage.model_copy(update=missing) if missing else stage
    if isinstance(stage, Mapping):
        return {**{k: v for k, v in defaults.items() if k not in stage}, **stage}
    return stage
