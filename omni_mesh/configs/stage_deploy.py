"""One stage's entry in a deploy config (:class:`StageDeployConfig`: replicas, devices, batch
sizes, connectors, engine knobs, autoscaling) and a named connector (:class:`ConnectorSpec`).
The whole config, with its pipeline-wide settings, is :mod:`omni_mesh.configs.deploy`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.deploy_fields import (
    MAX_LATENCY_MS,
    MAX_OUTPUT_BYTES,
    MAX_PARALLEL,
    MAX_REPLICAS,
    PIPELINE_ONLY_KEYS,
    ConnectorClass,
    DeviceList,
    Dtype,
    ExtraValue,
    InputKey,
    OutputKey,
    RefName,
    StageSampling,
)
from omni_mesh.configs.pipeline_spec import MAX_STAGES


class PrefillPool(BaseModel):
    """``prefill:`` of a stage entry: the stage is split into a prefill pool (this block) and a
    decode pool (the entry's own ``num_replicas``, and its ``autoscale:``). A request's prompt
    is prefilled on a prefill replica; its KV cache moves engine to engine (vLLM's
    ``NixlConnector``) to the decode replica that generates the tokens (docs/operations.md,
    "Prefill/decode split"). The prefill pool autoscales on its own with an ``autoscale:`` of
    its own (``num_replicas`` is then its starting count); without one it keeps its size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description="Replicas in the stage's prefill pool (its starting count when it autoscales).",
    )
    autoscale: AutoscaleConfig | None = Field(
        default=None,
        description="The prefill pool's own autoscaling policy, decided from its replicas' "
        "load only; null = the pool keeps num_replicas.",
    )

    @model_validator(mode="after")
    def _check_autoscale(self, info: ValidationInfo) -> Self:
        scale = self.autoscale
        if scale is None or context_flag(info, "layer"):
            return self
        if scale.min_replicas < 1:
            raise ValueError(
                "autoscale.min_replicas is 0, but a prefill pool cannot scale to zero: with no "
                "prefill replica the decode replicas prefill locally, so no load would ever "
                "wake it; set autoscale.min_replicas to at least 1"
            )
        if not scale.min_replicas <= self.num_replicas <= scale.max_replicas:
            raise ValueError(
                f"num_replicas ({self.num_replicas}) is the starting count of an autoscaled "
                f"prefill pool and must lie in [autoscale.min_replicas, "
                f"autoscale.max_replicas] = [{scale.min_replicas}, {scale.max_replicas}]"
            )
        return self

    @property
    def device_slots(self) -> int:
        """Replicas of the pool that may run at once: its largest size and its standbys."""
        scale = self.autoscale
        return self.num_replicas if scale is None else scale.max_replicas + scale.standby_replicas


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
        description="GPU indices for the whole pool, world_size per replica slot, e.g. '0,1,2,3'; "
        "each replica's engine sees only its slice (CUDA_VISIBLE_DEVICES); null = CPU.",
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
    prefill: PrefillPool | None = Field(
        default=None,
        description="vLLM stages and the qwen3-omni thinker: split prefill from decode; this "
        "block sizes (and may "
        "autoscale) the prefill pool, num_replicas and autoscale the decode pool (KV moved "
        "over NIXL).",
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
        if context_flag(info, "layer"):
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

    @property
    def device_slots(self) -> int:
        """Replicas that may run at once, each on its own slice of ``devices``: the largest
        pool, its warm standbys and a split stage's prefill pool (numbered after the others;
        an autoscaled one at its largest, with its standbys)."""
        return self.pool_slots + (self.prefill.device_slots if self.prefill else 0)

    @property
    def pool_slots(self) -> int:
        """Slots of the stage's own pool (a split stage's decode pool): its largest size and
        its warm standbys; a split stage's prefill slots follow them."""
        standby = self.autoscale.standby_replicas if self.autoscale else 0
        return self.max_pool_size + standby

    def replica_devices(self, replica: int) -> tuple[int, ...]:
        """The slice of ``devices`` that replica slot ``replica`` (0-based, below
        :attr:`device_slots`) runs on; () on CPU."""
        if not 0 <= replica < self.device_slots:
            raise ValueError(
                f"stage {self.stage_id} has no replica slot {replica} (it has "
                f"{self.device_slots}: 0 to {self.device_slots - 1})"
            )
        ws = self.world_size
        return self.device_ids[replica * ws : (replica + 1) * ws]

    def input_connector(self, from_stage: int) -> str | None:
        return self.input_connectors.get(f"from_stage_{from_stage}")

    def output_connector(self, to_stage: int) -> str | None:
        return self.output_connectors.get(f"to_stage_{to_stage}")


def context_flag(info: ValidationInfo, key: str) -> bool:
    return isinstance(info.context, Mapping) and bool(info.context.get(key))
