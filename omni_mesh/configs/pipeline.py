"""Deprecated: the old home of a plug-in's imports. Use :mod:`omni_mesh.api`.

Plug-ins written against this path (``from omni_mesh.configs.pipeline import PipelineSpec,
register_pipeline``) keep loading: every name this module used to hold is still found here
(:data:`MOVED`), with a DeprecationWarning and a log line (Python hides deprecations outside
``__main__``, an operator reads logs) naming where to import it now. The pipeline classes live
in :mod:`omni_mesh.configs.pipeline_spec`, the registry in :mod:`omni_mesh.configs.registry`;
none of omni-mesh's own modules imports this one.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from omni_mesh.configs import pipeline_spec, registry

logger = logging.getLogger(__name__)

_API = "omni_mesh.api"
#: Every name this module held -> (the module that holds it now, where to import it from).
MOVED: dict[str, tuple[Any, str]] = {
    **{
        name: (pipeline_spec, _API)
        for name in ("OutputKind", "PipelineError", "PipelineSpec", "StageSpec")
    },
    "UnknownPipelineError": (pipeline_spec, _API),
    **{
        name: (pipeline_spec, pipeline_spec.__name__)
        for name in ("UnknownStageError", "MAX_STAGES", "ImportPath", "StageName", "PipelineName")
    },
    **{name: (registry, _API) for name in ("register_pipeline", "get_pipeline", "list_pipelines")},
    **{
        name: (registry, registry.__name__)
        for name in (
            "PIPELINE_MODULES_ENV",
            "ENTRY_POINT_GROUP",
            "PipelineModuleError",
            "pipeline_modules_from",
            "load_pipeline_modules",
        )
    },
}
__all__ = sorted(MOVED)  # `import *` warns name by name
_warned: set[str] = set()


def __getattr__(name: str) -> Any:
    moved = MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, home = moved
    message = f"omni_mesh.configs.pipeline is deprecated: import {name} from {home}"
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    if name not in _warned:
        _warned.add(name)
        logger.warning("%s", message)
    return getattr(module, name)  # the very object the new home exports


def __dir__() -> list[str]:
    return sorted({*globals(), *MOVED})
