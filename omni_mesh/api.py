"""The public API for users' own pipelines: everything a plug-in module needs, in one place.

A plug-in (``--pipeline-module``, ``$OMNI_PIPELINE_MODULES`` or the ``omni_mesh.pipelines``
entry-point group) defines its stages' engines and registers its pipeline at import::

    from omni_mesh.api import (
        EngineRequest, EngineResult, OutputKind, PipelineSpec, StageData, StageEngine,
        StageSpec, register_pipeline,
    )

These names keep their meaning across releases, exported from here; the modules behind them are
internal and may move (``omni_mesh.configs.pipeline``, the earlier home of the pipeline names,
still gives them, with a DeprecationWarning naming this module).
Importing this module loads no torch, aiohttp or Redis client: the API servers and omni-up
import plug-ins too.
"""

from __future__ import annotations

from omni_mesh.configs.pipeline_spec import (
    OutputKind,
    PipelineError,
    PipelineSpec,
    StageSpec,
    UnknownPipelineError,
)
from omni_mesh.configs.registry import get_pipeline, list_pipelines, register_pipeline
from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.engines.base import (
    EngineConfigError,
    EngineContext,
    EngineInputError,
    EngineRequest,
    EngineResult,
    Processor,
    StageData,
    StageEngine,
)
from omni_mesh.engines.extras import extra_float, extra_int
from omni_mesh.engines.fields import FieldReader

__all__ = [
    "EngineConfigError",
    "EngineContext",
    "EngineInputError",
    "EngineRequest",
    "EngineResult",
    "FieldReader",
    "OutputKind",
    "PipelineError",
    "PipelineSpec",
    "Processor",
    "SamplingParams",
    "StageData",
    "StageEngine",
    "StageSpec",
    "UnknownPipelineError",
    "extra_float",
    "extra_int",
    "get_pipeline",
    "list_pipelines",
    "register_pipeline",
]
