"""glm-image's two engines, run stage by stage in-process on the tiny folder, against diffusers'
monolithic ``GlmImagePipeline.__call__`` with a generator of the same seed: the AR's prior tokens
are the pipeline's (its draws from the process RNG reproduced by the request's own generator),
and the final PNG's pixels are the pipeline's image, bit for bit: square and not, with and
without guidance, with quoted glyph text, through the engine cores with the pipeline's processor
between them, and whatever else is in a batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.media import png_bytes
from omni_mesh.data_plane.messages import Payload, StageInput, StageOutput
from omni_mesh.data_plane.tensors import array_from_tensor
from omni_mesh.engines.base import (
    EngineContext,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
    import_object,
)
from omni_mesh.engines.core import EngineCore
from omni_mesh.engines.glm_image.processors import ar_to_dit
from tests.engines.glm_image import glm_reference
from tests.engines.helpers import make_engine, stage_core, step_inline

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

STEPS = 4
FAR_FUTURE_MS = 4_102_444_800_000  # 2100-01-01


class Stages:
    def __init__(self) -> None:
        self.ar = make_engine("glm-image", 0)
        self.dit = make_engine("glm-image", 1, steps=STEPS)


@pytest.fixture(scope="module")
def stages() -> Stages:
    return Stages()


@pytest.fixture(scope="module")
def monolithic() -> Any:
    return glm_reference.monolithic()


def one(engine: StageEngine, data: StageData, seed: int) -> EngineResult:
    (result,) = engine.execute([EngineRequest("r1", seed, data)])
    assert result.error is None, result.error
    return result


def image_request(prompt: str, width: int, height: int, **fields: Any) -> StageData:
    return StageData(fields={"prompt": prompt, "width": width, "height": height, **fields})


CASES = [
    # seed, prompt, width, height, guidance
    (5, "a photo of a red fox in the snow", 64, 64, 1.5),
    (11, "a shop sign that says 'OPEN' and \u201cfresh bread\u201d", 96, 64, 1.5),
    (2**40 + 3, "a tall lighthouse", 32, 96, 1.0),  # no CFG: one DiT forward per step
    (0, 'a poster: "GLM" in bold', 64, 32, 4.0),
]


@pytest.mark.parametrize(("seed", "prompt", "width", "height", "guidance"), CASES)
def test_stage_by_stage_pixels_equal_the_pipeline(
    stages: Stages,
    monolithic: Any,
    seed: int,
    prompt: str,
    width: int,
    height: int,
    guidance: float,
) -> None:
    want = glm_reference.pipeline_pixels(monolithic, prompt, seed, width, height, STEPS, guidance)
    ar = one(stages.ar, image_request(prompt, width, height, guidance_scale=guidance), seed)
    grid = ar.output.arrays["prior_token_ids"]
    assert grid.shape == (height // 32, width // 32) and grid.dtype == np.int64
    # the AR's tokens are the pipeline's own (upsampled 2x for the DiT)
    generator = torch.Generator().manual_seed(seed)
    ids, _, _ = monolithic.generate_prior_tokens(prompt, height, width, generator=generator)
    up = monolithic._upsample_token_ids(torch.from_numpy(grid).reshape(-1), *grid.shape)
    assert torch.equal(up, ids)
    dit = one(stages.dit, ar_to_dit(ar.output), seed)
    assert dit.final is not None
    assert dit.final.fields == {"width": width, "height": height}
    image = dit.final.arrays["image"]
    assert image.shape == (height, width, 3) and image.dtype == np.uint8
    assert np.array_equal(glm_reference.png_pixels(png_bytes(image)), want)  # bit for bit
    assert len(np.unique(want)) > 32  # a real image, not a flat one


def test_the_dit_takes_its_steps_from_the_request(stages: Stages, monolithic: Any) -> None:
    prompt, seed = "a bowl of fruit", 21
    want = glm_reference.pipeline_pixels(monolithic, prompt, seed, 64, 64, 2, 1.5)
    ar = one(stages.ar, StageData(fields={"prompt": prompt, "size": 64, "steps": 2}), seed)
    assert ar.output.fields["steps"] == 2
    dit = one(stages.dit, ar_to_dit(ar.output), seed)
    assert dit.final is not None
    assert np.array_equal(dit.final.arrays["image"], want)
    four = one(
        stages.dit, ar_to_dit(StageData(ar.output.fields | {"steps": 4}, ar.output.arrays)), seed
    )
    assert four.final is not None and not np.array_equal(four.final.arrays["image"], want)


def test_a_request_batched_with_others_gets_its_lone_image(stages: Stages) -> None:
    requests = [
        EngineRequest(f"r{i}", seed, image_request(f"scene {i}", 64, 64))
        for i, seed in enumerate((3, 4, 3))
    ]
    ars = stages.ar.execute(requests)
    assert [r.error for r in ars] == [None] * 3
    lone = one(stages.ar, image_request("scene 0", 64, 64), 3)
    assert np.array_equal(
        ars[0].output.arrays["prior_token_ids"], lone.output.arrays["prior_token_ids"]
    )
    dits = stages.dit.execute(
        [
            EngineRequest(r.request_id, q.seed, ar_to_dit(r.output))
            for r, q in zip(ars, requests, strict=True)
        ]
    )
    alone = one(stages.dit, ar_to_dit(lone.output), 3)
    assert dits[0].final is not None and alone.final is not None
    assert np.array_equal(dits[0].final.arrays["image"], alone.final.arrays["image"])


def run_all(core: EngineCore, entry: StageInput) -> list[StageOutput]:
    """Every output of ``entry``, the core stepped until it runs nothing."""
    outputs = step_inline(core, entry)
    while core.running:
        outputs += step_inline(core)
    return outputs


def test_the_engine_cores_hand_off_what_the_dit_needs(monolithic: Any) -> None:
    """Through the engine cores as the engine processes run them: the AR's output goes through
    the pipeline's processor into the DiT's StageInput (token ids, prompt, size; the seed on
    the hop), and the DiT's final image is the pipeline's."""
    prompt, seed = "a 'tiny' robot", 17
    spec = get_pipeline("glm-image")
    ar_core = stage_core(spec.name, 0)
    dit_core = stage_core(spec.name, 1, steps=STEPS)
    entry = StageInput(
        pipeline=spec.name,
        request_id="core-1",
        stage_id=0,
        deadline_ms=FAR_FUTURE_MS,
        seed=seed,
        payload=Payload(fields={"prompt": prompt, "size": 64}),
    )
    (ar_out,) = run_all(ar_core, entry)  # the AR answers when its row ends, steps later
    assert ar_out.error is None and ar_out.final is None
    (hop,) = ar_out.next
    assert hop.stage_id == 1 and hop.seed == seed
    assert set(hop.payload.fields) == {"prompt", "width", "height"}
    assert set(hop.payload.tensors) == {"prior_token_ids"}
    assert array_from_tensor(hop.payload.tensors["prior_token_ids"]).nbytes == 2 * 2 * 8
    (dit_out,) = run_all(dit_core, hop)
    assert dit_out.error is None and dit_out.final is not None and not dit_out.next
    image = array_from_tensor(dit_out.final.tensors["image"])
    want = glm_reference.pipeline_pixels(monolithic, prompt, seed, 64, 64, STEPS, 1.5)
    assert np.array_equal(image, want)


def test_bfloat16_stages_equal_the_bfloat16_pipeline() -> None:
    """The stages in the stage's ``dtype: bfloat16`` (the real checkpoint's) against the
    pipeline loaded in bfloat16: the same pixels."""
    spec = get_pipeline("glm-image")

    def engine(stage_id: int, **extras: Any) -> StageEngine:
        config = StageDeployConfig(stage_id=stage_id, dtype="bfloat16", engine_extras=extras)
        made: StageEngine = import_object(spec.stage(stage_id).engine)(
            EngineContext(spec, spec.stage(stage_id), config)
        )
        made.load()
        return made

    ar, dit = engine(0), engine(1, steps=STEPS)
    assert ar.model.dtype == dit.model.dtype == torch.bfloat16  # type: ignore[attr-defined]
    pipe = glm_reference.monolithic(torch.bfloat16)
    prompt, seed = "a 'red' fox", 2
    want = glm_reference.pipeline_pixels(pipe, prompt, seed, 64, 64, STEPS, 1.5)
    prior = one(ar, image_request(prompt, 64, 64), seed)
    image = one(dit, ar_to_dit(prior.output), seed)
    assert image.final is not None
    assert np.array_equal(image.final.arrays["image"], want)
