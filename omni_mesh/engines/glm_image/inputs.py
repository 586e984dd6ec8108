"""What both glm-image stages read of a request: the prompt and the image size, validated.

The size: field ``size`` (a square's side, as the images route gives it) or fields ``width`` and
``height`` (both; they win over ``size``), in pixels. GLM-Image makes an image of H/32 x W/32
target tokens, each upsampled 2x for the DiT, whose latent is H/8 x W/8 in patches of 2: every
side must be a multiple of :data:`MULTIPLE` (32; ``GlmImagePipeline.check_inputs`` refuses others,
and its processor would round them down). Without a size a request takes the stage's
``engine_extras.size`` (1024, the real model's usual side); the AR hands the size it used on to
the DiT.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_mesh.engines.fields import FieldReader

MULTIPLE = 32
DEFAULT_SIDE = 1024
MAX_SIDE = 4096  # the real DiT's rope reaches 2048 px at sample size 128; engines set their own


@dataclass(frozen=True)
class ImageSize:
    """An image's size in pixels, both sides multiples of :data:`MULTIPLE`."""

    width: int
    height: int

    @property
    def grid(self) -> tuple[int, int]:
        """The AR's target grid (rows, columns): one token per 32 x 32 pixels."""
        return self.height // MULTIPLE, self.width // MULTIPLE


def image_size(fields: FieldReader, default: int | None, max_side: int) -> ImageSize:
    """The request's size (module docstring), each side in [32, ``max_side``]; ``default``
    None: a size is required."""
    if fields.has("width") or fields.has("height"):
        width = _side(fields, "width", max_side)
        height = _side(fields, "height", max_side)
        if width is None or height is None:
            missing = "width" if width is None else "height"
            raise fields.error("field", missing, "is required with 'width' or 'height'")
        return ImageSize(width, height)
    side = _side(fields, "size", max_side)
    if side is None:
        if default is None:
            raise fields.error("field", "size", "is required (or 'width' and 'height')")
        side = default
    return ImageSize(side, side)


def _side(fields: FieldReader, name: str, max_side: int) -> int | None:
    value = fields.optional_int(name, None, MULTIPLE, max_side)
    if value is not None and value % MULTIPLE:
        raise fields.error("field", name, f"must be a multiple of {MULTIPLE}, got {value}")
    return value
