"""Engine modules that moved, for code that still names them by their old path.

When issue #32 gave every model family its own folder, the modules of ``engines/hf`` moved. A
pipeline that names a built-in stage's engine or processor by its old ``"module:name"`` path
keeps loading (:func:`current_module`, used by ``import_object``), and so does a Python import
of an old module (:class:`OldPaths`, installed when ``omni_mesh.engines`` is imported: the old
name is the new module itself). Either way a DeprecationWarning and a log line name the new
path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

logger = logging.getLogger(__name__)

_OLD = "omni_mesh.engines."
#: old module (under omni_mesh.engines) -> its module now
MOVED: dict[str, str] = {
    "hf.qwen3_omni_thinker": "qwen3_omni.thinker",
    "hf.qwen3_omni_thinker_batch": "qwen3_omni.thinker_batch",
    "hf.qwen3_omni_talker": "qwen3_omni.talker",
    "hf.qwen3_omni_talker_batch": "qwen3_omni.talker_batch",
    "hf.qwen3_omni_talker_prompt": "qwen3_omni.talker_prompt",
    "hf.qwen3_omni_code2wav": "qwen3_omni.code2wav",
    "hf.qwen3_omni_inputs": "qwen3_omni.inputs",
    "hf.qwen3_omni_processors": "qwen3_omni.processors",
    "hf.qwen3_omni_tiny": "qwen3_omni.tiny",
    "hf.speakers": "qwen3_omni.speakers",
    "hf.csm_talker": "csm.talker",
    "hf.csm_talker_batch": "csm.talker_batch",
    "hf.csm_code2wav": "csm.code2wav",
    "hf.csm_processors": "csm.processors",
    "hf.csm_tiny": "csm.tiny",
    "hf.frame_batch": "batching.frame_batch",
    "hf.frame_engine": "batching.frame_engine",
    "hf.frame_stream": "batching.frame_stream",
    "hf.padded_cache": "batching.padded_cache",
    "hf.row_sampling": "batching.row_sampling",
    "hf.kv_split": "batching.kv_split",
    "hf.kv_arena": "kv.arena",
    "hf.kv_exchange": "kv.exchange",
    "hf.kv_params": "kv.params",
    "hf.kv_pull": "kv.pull",
    "nixl_agents": "kv.nixl_agents",
    "kv_counts": "kv.counts",
}


def current_module(name: str) -> str:
    """``name``, or the module it moved to (with a DeprecationWarning naming both)."""
    moved = MOVED.get(name.removeprefix(_OLD)) if name.startswith(_OLD) else None
    if moved is None:
        return name
    _say(f"{name} moved to {_OLD}{moved}; use the new path")
    return _OLD + moved


def _say(message: str) -> None:
    """A DeprecationWarning, and a log line: processes hide deprecations outside __main__."""
    logger.warning("%s", message)
    warnings.warn(message, DeprecationWarning, stacklevel=4)


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import omni_mesh.engines.hf.qwen3_omni_talker`` gives the module it moved to."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_OLD) or fullname.removeprefix(_OLD) not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(current_module(spec.name))  # the new module itself

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported."""


def install() -> None:
    """Add the finder for old module paths (once)."""
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.append(OldPaths())


def moved_name(module: str, name: str, homes: dict[str, tuple[str, str]]) -> object:
    """A module ``__getattr__``'s answer for a name that moved out of ``module``: ``homes``
    maps it to (its module now, its name there); AttributeError for any other name."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, new_name = home
    _say(f"{module}.{name} moved to {new_module}.{new_name}; use the new path")
    return getattr(importlib.import_module(new_module), new_name)
