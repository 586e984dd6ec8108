"""The AR stage's parts against transformers' own: the 3D rope positions it passes explicitly
are those ``GlmImageModel.get_rope_index`` makes (and caches) for the same prompt and grids, at
several sizes; its draw is ``generate(do_sample=True)``'s for the generation config (transformers'
defaults for unset fields), and a config asking for a processor the stage does not apply is
refused at start, naming the field."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.engines.base import EngineConfigError, EngineContext
from omni_mesh.engines.batching.row_sampling import Sampling
from omni_mesh.engines.glm_image.positions import decode_positions, prompt_positions
from omni_mesh.engines.glm_image.sampling import generation_sampling
from omni_mesh.engines.hf.folders import resolve_folder

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def ar_parts() -> tuple[Any, Any]:
    from transformers import AutoProcessor, GlmImageForConditionalGeneration

    folder = resolve_folder("tiny-glm-image")
    model = GlmImageForConditionalGeneration.from_pretrained(
        str(folder / "vision_language_encoder")
    )
    return model.eval(), AutoProcessor.from_pretrained(str(folder / "processor"))


@pytest.mark.parametrize(("height", "width"), [(64, 64), (64, 160), (256, 32), (1024, 768)])
def test_positions_are_the_models_own(ar_parts: tuple[Any, Any], height: int, width: int) -> None:
    model, processor = ar_parts
    messages = [[{"role": "user", "content": [{"type": "text", "text": "a 'sign' at dawn"}]}]]
    inputs = processor.apply_chat_template(
        messages,
        tokenize=True,
        images_kwargs={"target_h": height, "target_w": width},
        return_dict=True,
        return_tensors="pt",
    )
    ids, grid_thw = inputs["input_ids"], inputs["image_grid_thw"]
    assert grid_thw[0].tolist() == [1, height // 32, width // 32]
    want, _ = model.model.get_rope_index(
        ids, grid_thw, inputs["images_per_sample"], inputs["attention_mask"]
    )
    cpu = torch.device("cpu")
    assert torch.equal(prompt_positions(ids.shape[-1], cpu), want)
    grids = [(int(t[1]), int(t[2])) for t in grid_thw]
    decoded = decode_positions(ids.shape[-1], grids, cpu)
    assert decoded.shape[1] == sum(h * w for h, w in grids) + 1
    assert torch.equal(decoded, model.model._cached_decode_position_ids[0])


def _ctx() -> EngineContext:
    spec = get_pipeline("glm-image")
    return EngineContext(spec, spec.stage(0), StageDeployConfig(stage_id=0))


def test_unset_fields_take_transformers_defaults() -> None:
    from transformers import GenerationConfig

    assert generation_sampling(GenerationConfig(), _ctx()) == Sampling(
        do_sample=True, temperature=1.0, top_k=50, top_p=1.0, repetition_penalty=1.0
    )
    config = GenerationConfig(temperature=0.7, top_k=0, top_p=0.8, repetition_penalty=1.1)
    assert generation_sampling(config, _ctx()) == Sampling(
        do_sample=True, temperature=0.7, top_k=0, top_p=0.8, repetition_penalty=1.1
    )


@pytest.mark.parametrize(
    "field", [{"min_new_tokens": 3}, {"no_repeat_ngram_size": 2}, {"suppress_tokens": [1]}]
)
def test_a_processor_the_stage_does_not_apply_is_refused(field: dict[str, Any]) -> None:
    from transformers import GenerationConfig

    (name,) = field
    with pytest.raises(EngineConfigError, match=f"sets {name}="):
        generation_sampling(GenerationConfig(**field), _ctx())
