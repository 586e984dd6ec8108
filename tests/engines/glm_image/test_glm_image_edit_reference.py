"""The reference for glm-image's image editing (issue 34, not served yet): diffusers'
``GlmImagePipeline`` edit path fails with transformers 5.19 (``glm_reference.
with_edit_workaround`` says why); worked around in the tests only, it runs, is deterministic for
a seed and reads its condition image. The day diffusers fixes it, the first test fails: drop the
workaround."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tests.engines.glm_image import glm_reference

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

STEPS, GUIDANCE = 4, 1.5


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_the_upstream_edit_path_fails_without_the_workaround() -> None:
    pipe = glm_reference.monolithic()
    with pytest.raises(RuntimeError, match="channels"):
        glm_reference.edit_pixels(pipe, "make it 'RED'", _image(0), 5, 64, 64, STEPS, GUIDANCE)


def test_the_worked_around_edit_is_deterministic_and_reads_its_image() -> None:
    pipe = glm_reference.with_edit_workaround(glm_reference.monolithic())
    args = ("make it 'RED'",)
    first = glm_reference.edit_pixels(pipe, *args, _image(0), 5, 64, 64, STEPS, GUIDANCE)
    again = glm_reference.edit_pixels(pipe, *args, _image(0), 5, 64, 64, STEPS, GUIDANCE)
    other = glm_reference.edit_pixels(pipe, *args, _image(1), 5, 64, 64, STEPS, GUIDANCE)
    assert first.shape == (64, 64, 3) and np.array_equal(first, again)
    assert not np.array_equal(first, other)  # the condition image is read
