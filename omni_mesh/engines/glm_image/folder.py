"""A glm-image stage's parts of its model folder, laid out as the real checkpoint is (one subfolder
per ``GlmImagePipeline`` component, ``model_index.json`` at the top): each stage reads only its
own subfolders, on its device, in its dtype (``engines/devices.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni_mesh.engines.base import EngineConfigError, EngineContext
from omni_mesh.engines.devices import torch_dtype
from omni_mesh.engines.hf.common import model_folder

DEFAULT_MODEL = "tiny-glm-image"


def stage_folder(ctx: EngineContext) -> Path:
    """The folder of ``engine_extras.model`` (tiny-glm-image by default, built if need be)."""
    return model_folder(ctx, DEFAULT_MODEL)


def part(ctx: EngineContext, folder: Path, name: str) -> Path:
    """Subfolder ``name`` of ``folder``; a config error naming it when the folder lacks it."""
    path = folder / name
    if not path.is_dir():
        raise EngineConfigError(
            f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): model folder {str(folder)!r} has no "
            f"{name}/ (a GLM-Image folder holds vision_language_encoder/, processor/, "
            "transformer/, vae/, text_encoder/, tokenizer/, scheduler/)"
        )
    return path


def dtype_kwargs(ctx: EngineContext) -> dict[str, Any]:
    """``{"dtype": ...}`` for ``from_pretrained`` (transformers' and diffusers' name alike;
    diffusers 0.42 deprecates ``torch_dtype``) when the stage names a dtype; nothing (the
    library's default) when it is ``auto``."""
    dtype = torch_dtype(ctx)
    return {"dtype": dtype} if isinstance(dtype, torch.dtype) else {}
