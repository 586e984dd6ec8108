"""Building and running reference engines in-process, for the engine tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import StageInput, StageOutput
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
