"""Deprecated: the old home of a plug-in's imports. Use :mod:`omni_mesh.api`.

Plug-ins written against this path (``from omni_mesh.configs.pipeline import PipelineSpec,
register_pipeline``) keep loading: every name is still found here, with a DeprecationWarning
naming where to import it now. The pipeline classes live in
:mod:`omni_mesh.configs.pipeline_spec`, the registry in :mod:`omni_mesh.configs.registry`; none
of omni-mesh's own modules imports this one.
"""

from __future__ import annotations

import warnings
from typing import Any

from omni_mesh.configs import pipeline_spec, registry

#: Names a plug-in imports: found in omni_mesh.api.
_PUBLIC = frozenset(
    {
        "OutputKind",
        "PipelineError",
        "PipelineSpec",
        "StageSpec",
        "UnknownPipelineError",
        "get_pipeline",
        "list_pipelines",
        "register_pipeline",
    }
)


def __getattr__(name: str) -> Any:
    for module in (pipeline_spec, registry):
        if not name.startswith("__") and hasattr(module, name):
            new = "omni_mesh.api" if name in _PUBLIC else module.__name__
            warnings.warn(
                f"omni_mesh.configs.pipeline is deprecated: import {name} from {new}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(module, name)  # the object omni_mesh.api exports
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
