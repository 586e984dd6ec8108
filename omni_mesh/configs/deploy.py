"""Deploy configuration schema: how each stage of a pipeline runs.

A deploy config says how many replicas a stage has, which devices they use, how large their
batches are, which connector carries each edge of the pipeline's DAG and which engine knobs they
get. The topology itself is a :class:`~omni_mesh.configs.pipeline_spec.PipelineSpec` (Python, never
YAML). YAML files, platform sections and command-line overrides are merged into these models by
:mod:`omni_mesh.configs.loader`; nothing else reads raw deploy dicts.

A stage's entry (:class:`StageDeployConfig`) and a named connector live in
:mod:`~omni_mesh.configs.stage_deploy`, field types and limits in
:mod:`~omni_mesh.configs.deploy_fields`, cross-field checks in
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
    edge_stage,
)
from omni_mesh.configs.errors import ConfigIssue, DeployConfigError
from omni_mesh.configs.pipeline_spec import MAX_STAGES, PipelineSpec
from omni_mesh.configs.stage_deploy import (
    ConnectorSpec,
    StageDeployConfig,
    check_stage_keys,
    context_flag,
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
        if context_flag(info, "layer") or not isinstance(data, Mapping):
            return data
        defaults = {k: data[k] for k in STAGE_DEFAULT_KEYS if data.get(k) is not None}
        stages = data.get("stages")
        if not defaults or not isinstance(stages, list):
            return data
        return {**data, "stages": [_with_defaults(s, defaults) for s in stages]}

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Self:
        if context_flag(info, "layer") or context_flag(info, "defer_checks"):
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
