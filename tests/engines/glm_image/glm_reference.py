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


def with_edit_workaround(pipe: Any) -> Any:
    """``pipe`` whose edit path (``image=``) runs: the reference for image editing, worked
    around here only.

    The upstream bug (diffusers 0.42.1 with transformers 5.19): ``generate_prior_tokens`` takes
    the condition images' features from ``get_image_features(...).pooler_output`` (a list of one
    [C, h, w] map per image), ``torch.cat``'s them into one [N*C, h, w] tensor and passes that to
    ``get_image_tokens``, which iterates over its argument expecting one [C, h, w] map per image:
    it gets [h, w] slices and the VQ encoder's first conv fails on 1 channel instead of C. The
    workaround wraps this instance's ``vision_language_encoder.get_image_tokens`` to split such a
    tensor back into the N per-image maps (N = the rows of ``image_grid_thw``) before calling the
    original; nothing else of the pipeline changes."""
    encoder = pipe.vision_language_encoder
    original = encoder.get_image_tokens

    def per_image(hidden_states: Any, image_grid_thw: Any = None) -> Any:
        if isinstance(hidden_states, torch.Tensor) and image_grid_thw is not None:
            channels = hidden_states.shape[0] // len(image_grid_thw)
            hidden_states = list(hidden_states.split(channels))
        return original(hidden_states, image_grid_thw)

    encoder.get_image_tokens = per_image
    return pipe


def edit_pixels(
    pipe: Any,
    prompt: str,
    image: Image.Image,
    seed: int,
    width: int,
    height: int,
    steps: int,
    guidance: float,
) -> np.ndarray:
    """uint8 [H, W, 3] of ``pipe(prompt, image=[image], ...)`` (``pipe`` worked around by
    :func:`with_edit_workaround`) with ``torch.Generator().manual_seed(seed)``."""
    generator = torch.Generator().manual_seed(seed)
    (out,) = pipe(
        prompt,
        image=[image],
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=generator,
    ).images
    return np.asarray(out.convert("RGB"))
