"""glm-image partial images in-process: a DiT stream asked for ``partial_images`` yields that
many previews (chunks for the client alone, ``partial_image_index`` 0, 1, …, after evenly spaced
steps: the VAE decode of each step's estimate of the clean latent) and then the image, still
equal to ``GlmImagePipeline.__call__`` pixel for pixel; each preview is nearer the image than the
one before."""

from __future__ import annotations

import numpy as np
import pytest

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.glm_image.dit import preview_steps
from omni_mesh.engines.glm_image.processors import ar_to_dit
from tests.engines.glm_image import glm_reference
from tests.engines.helpers import make_engine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

STEPS, GUIDANCE = 9, 1.5


def test_previews_come_after_evenly_spaced_steps() -> None:
    assert preview_steps(9, 2) == {3, 6}
    assert preview_steps(8, 3) == {2, 4, 6}
    assert preview_steps(50, 1) == {25}
    assert preview_steps(2, 3) == {1}  # fewer steps than previews: fewer previews
    assert preview_steps(1, 3) == frozenset() and preview_steps(9, 0) == frozenset()


def test_a_stream_sends_its_previews_then_the_pipelines_image() -> None:
    seed, prompt, width, height = 21, "a 'tiny' harbour", 96, 64
    ar = make_engine("glm-image", 0)
    dit = make_engine("glm-image", 1, steps=STEPS)
    fields = {"prompt": prompt, "width": width, "height": height, "partial_images": 2}
    (prior,) = ar.execute([EngineRequest("ar", seed, StageData(fields))])
    assert prior.error is None, prior.error
    (stream,) = dit.open([EngineRequest("dit", seed, ar_to_dit(prior.output))])
    items = list(stream)
    results = [(i, r) for i, r in enumerate(items) if r is not None]
    assert [i + 1 for i, _ in results] == [3, 6, STEPS]  # after steps 3 and 6, then the image
    *previews, image = [r for _, r in results]
    want = glm_reference.pipeline_pixels(
        glm_reference.monolithic(), prompt, seed, width, height, STEPS, GUIDANCE
    )
    assert image is not None and image.last and image.final is not None
    assert np.array_equal(image.final.arrays["image"], want)
    distances = []
    for index, preview in enumerate(previews):
        assert isinstance(preview, EngineResult) and not preview.last and not preview.forward
        assert preview.final is not None and preview.final.fields["partial_image_index"] == index
        pixels = preview.final.arrays["image"]
        assert pixels.shape == (height, width, 3) and pixels.dtype == np.uint8
        distances.append(np.abs(pixels.astype(int) - want.astype(int)).mean())
    assert distances[0] > distances[1] > 0, distances
