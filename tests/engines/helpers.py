"""Building and running reference engines in-process, for the engine tests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import StageInput, StageOutput
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import (
    EngineContext,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
    import_object,
)
from omni_mesh.engines.core import ArrayReader, ArrayWriter, EngineCore


def make_engine(pipeline: str, stage_id: int, **extras: Any) -> StageEngine:
    """The registered engine of a stage, loaded, with ``extras`` as its engine_extras."""
    spec = get_pipeline(pipeline)
    stage = spec.stage(stage_id)
    config = StageDeployConfig(stage_id=stage_id, engine_extras=extras)
    engine: StageEngine = import_object(stage.engine)(EngineContext(spec, stage, config))
    engine.load()
    return engine


def run_one(engine: StageEngine, data: StageData, seed: int = 7, **kw: Any) -> EngineResult:
    """Execute one request alone; it must succeed."""
    (result,) = engine.execute([EngineRequest("req-1", seed, data, **kw)])
    assert result.error is None
    return result


def core_step(
    core: EngineCore,
    batch: Sequence[tuple[StageInput, float]],
    read: ArrayReader,
    write: ArrayWriter,
) -> list[StageOutput]:
    """One :meth:`EngineCore.advance`, its outputs only (the inputs they answer dropped)."""
    return [out for _, out in core.advance(batch, read, write)]


def stage_core(pipeline: str, stage_id: int, **extras: Any) -> EngineCore:
    """The engine core of a stage as its engine process builds it (the class its settings
    pick), loaded, ``async_chunk`` on, with ``extras`` as its engine_extras."""
    spec = get_pipeline(pipeline)
    config = StageDeployConfig(stage_id=stage_id, engine_extras=extras)
    ctx = EngineContext(spec, spec.stage(stage_id), config, async_chunk=True)
    core = EngineCore.build(ctx)
    core.engine.load()
    return core


def write_inline(arr: Any, owner: str) -> Any:
    """An :data:`ArrayWriter` that keeps outputs inline (no shared memory)."""
    return tensor_from_array(arr.copy())


def step_inline(core: EngineCore, *inputs: StageInput) -> list[StageOutput]:
    """One :meth:`EngineCore.advance` of ``inputs`` (enqueued now), tensors inline."""
    now = time.monotonic()
    return core_step(core, [(x, now) for x in inputs], array_from_tensor, write_inline)
