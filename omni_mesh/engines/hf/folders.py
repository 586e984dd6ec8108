"""Model folders of the real-architecture stages: a tiny registered name or a real folder.

A tiny name (``tiny-qwen3-omni``, ``tiny-csm``) is built the first time it is needed, by code in
this repository (random weights from a fixed seed, the real config classes with shrunk sizes,
``save_pretrained``), into ``<cache>/<name>-v<version>``, once per machine
(``model_cache.build_once``). Anything else must be an existing folder with a ``config.json`` (or
a diffusers pipeline's ``model_index.json``): a real checkpoint takes the same path as a tiny one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omni_mesh.engines.model_cache import build_once, default_cache_dir, existing_folder


class ModelFolderError(ValueError):
    """A ``model`` that is neither a tiny model name nor an existing model folder."""


@dataclass(frozen=True)
class TinyBuilder:
    """Where a tiny model's builder lives (imported only when the folder must be built)."""

    builder: str  # "module:function", function(folder: Path) -> None writes the whole folder
    version: int


#: Registered tiny models of the real-architecture pipelines.
TINY_FOLDERS: dict[str, TinyBuilder] = {
    "tiny-qwen3-omni": TinyBuilder("omni_mesh.engines.qwen3_omni.tiny:write_tiny_model", 2),
    "tiny-csm": TinyBuilder("omni_mesh.engines.csm.tiny:write_tiny_model", 1),
    "tiny-glm-image": TinyBuilder("omni_mesh.engines.glm_image.tiny:write_tiny_model", 1),
}


def resolve_folder(model: str, cache_dir: Path | None = None) -> Path:
    """The folder a stage loads for ``model`` (module docstring)."""
    if model in TINY_FOLDERS:
        return ensure_tiny_folder(model, cache_dir or default_cache_dir())
    return existing_folder(model, TINY_FOLDERS, ModelFolderError)


def ensure_tiny_folder(name: str, cache_dir: Path) -> Path:
    """Build tiny model ``name`` into ``cache_dir`` unless it is there already; its folder."""
    spec = TINY_FOLDERS[name]
    return build_once(cache_dir / f"{name}-v{spec.version}", _builder(spec.builder))


def _builder(path: str) -> Callable[[Path], None]:
    module, _, attr = path.partition(":")
    fn: Callable[[Path], None] = getattr(importlib.import_module(module), attr)
    return fn
