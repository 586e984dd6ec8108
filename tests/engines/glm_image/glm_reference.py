"""diffusers' monolithic ``GlmImagePipeline`` on the tiny folder: what the glm-image stages must
equal."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image

from omni_mesh.engines.hf.folders import resolve_folder

MODEL = "tiny-glm-image"


def monolithic(dtype: torch.dtype | None = None) -> Any:
    """``GlmImagePipeline.from_pretrained`` of the tiny folder (built if need be), in ``dtype``
    (the checkpoint's when None)."""
    from diffusers import GlmImagePipeline

    kwargs = {} if dtype is None else {"dtype": dtype}
    return GlmImagePipeline.from_pretrained(str(resolve_folder(MODEL)), **kwargs)


def pipeline_pixels(
    pipe: Any, prompt: str, seed: int, width: int, height: int, steps: int, guidance: float
) -> np.ndarray:
    """uint8 [H, W, 3] of ``pipe(prompt, ...)`` with ``torch.Generator().manual_seed(seed)``."""
    generator = torch.Generator().manual_seed(seed)
    (image,) = pipe(
        prompt,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=generator,
    ).images
    return np.asarray(image.convert("RGB"))


def png_pixels(png: bytes) -> np.ndarray:
    """The pixels of a PNG file, uint8 [H, W, 3]."""
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"))
