"""tiny-image reference engines (AR image tokens → DiT): shapes, determinism, PNG, validation."""

from __future__ import annotations

import numpy as np
import pytest

from omni_mesh.data_plane.media import png_bytes
from omni_mesh.engines.base import (
    EngineInputError,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)
from omni_mesh.engines.reference.processors import ar_to_dit
from tests.engines.helpers import make_engine, run_one
from tests.media_readers import read_png, read_png_size

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def ar() -> StageEngine:
    return make_engine("tiny-image", 0)


@pytest.fixture(scope="module")
def dit() -> StageEngine:
    return make_engine("tiny-image", 1)


def image_of(result: EngineResult) -> np.ndarray:
    assert result.final is not None
    return result.final.arrays["image"]


def test_ar_emits_an_8x8_token_grid(ar: StageEngine) -> None:
    out = run_one(ar, StageData({"prompt": "a red fox", "size": 32, "steps": 4}), seed=3).output
    tokens = out.arrays["image_tokens"]
    assert tokens.dtype == np.int64 and tokens.shape == (8, 8)
    assert tokens.min() >= 0 and tokens.max() < 512
    assert out.fields == {"size": 32, "steps": 4}
    dit_input = ar_to_dit(out)
    assert dit_input.fields == {"size": 32, "steps": 4}
    assert dit_input.arrays["image_tokens"] is tokens


@pytest.mark.parametrize(("fields", "size"), [({}, 64), ({"size": 48, "steps": 3}, 48)])
def test_chain_produces_a_png_of_the_requested_size(
    ar: StageEngine, dit: StageEngine, fields: dict[str, int], size: int
) -> None:
    tokens = run_one(ar, StageData({"prompt": "a lighthouse at dusk", **fields}), seed=3).output
    image = image_of(run_one(dit, ar_to_dit(tokens), seed=3))
    assert image.dtype == np.uint8 and image.shape == (size, size, 3)
    assert image.std() > 0
    png = png_bytes(image)
    assert read_png_size(png) == (size, size)
    assert np.array_equal(read_png(png), image)


def test_same_seed_same_image_other_seed_differs(ar: StageEngine, dit: StageEngine) -> None:
    prompt = StageData({"prompt": "mountains"})
    tokens = [run_one(ar, prompt, seed=s).output.arrays["image_tokens"] for s in (5, 5, 6)]
    assert tokens[0].tobytes() == tokens[1].tobytes()
    assert tokens[0].tobytes() != tokens[2].tobytes()
    grid = StageData(arrays={"image_tokens": tokens[0]})
    images = [image_of(run_one(dit, grid, seed=s)) for s in (5, 5, 6)]
    assert images[0].tobytes() == images[1].tobytes()
    assert images[0].tobytes() != images[2].tobytes()
    fewer_steps = StageData({"steps": 2}, {"image_tokens": tokens[0]})
    assert image_of(run_one(dit, fewer_steps, seed=5)).tobytes() != images[0].tobytes()


def test_batch_does_not_change_a_requests_output(ar: StageEngine, dit: StageEngine) -> None:
    target = EngineRequest("t", 11, StageData({"prompt": "a cat"}))
    others = [
        EngineRequest("o1", 11, StageData({"prompt": "a dog on a skateboard"})),
        EngineRequest("o2", 12, StageData({"prompt": "a"})),
    ]
    alone = ar.execute([target])[0].output
    batched = {r.request_id: r.output for r in ar.execute([others[0], target, others[1]])}
    assert batched["t"].arrays["image_tokens"].tobytes() == alone.arrays["image_tokens"].tobytes()
    grid = alone.arrays["image_tokens"]
    d_target = EngineRequest("t", 11, StageData({"size": 32}, {"image_tokens": grid}))
    d_other = EngineRequest("o", 11, StageData({"size": 80, "steps": 3}, {"image_tokens": grid}))
    d_alone = image_of(dit.execute([d_target])[0])
    d_batched = {r.request_id: image_of(r) for r in dit.execute([d_other, d_target, d_other])}
    assert d_batched["t"].tobytes() == d_alone.tobytes()


GRID = np.zeros((8, 8), np.int64)
BAD_INPUTS = [
    ("ar", StageData({"size": 64}), "'prompt' is required"),
    ("ar", StageData({"prompt": "x", "size": 8}), "'size' must be in [16, 512]"),
    ("ar", StageData({"prompt": "x", "steps": 500}), "'steps' must be in [1, 200]"),
    ("dit", StageData(), "'image_tokens' is required"),
    ("dit", StageData(arrays={"image_tokens": np.zeros((64,), np.int64)}), "must have shape"),
    ("dit", StageData(arrays={"image_tokens": GRID + 512}), "must hold ids in [0, 512)"),
    ("dit", StageData(arrays={"image_tokens": GRID.astype(np.uint8)}), "must be int64"),
    ("dit", StageData({"size": 1024}, {"image_tokens": GRID}), "'size' must be in"),
    ("dit", StageData({"steps": 0}, {"image_tokens": GRID}), "'steps' must be in"),
    ("dit", StageData({"size": 32.5}, {"image_tokens": GRID}), "'size' must be an integer"),
]


@pytest.mark.parametrize(("stage", "data", "message"), BAD_INPUTS)
def test_bad_inputs_name_stage_and_field(
    stage: str, data: StageData, message: str, ar: StageEngine, dit: StageEngine
) -> None:
    engine = {"ar": ar, "dit": dit}[stage]
    (result,) = engine.execute([EngineRequest("bad-img", 1, data)])
    assert result.error is not None and f"stage '{stage}'" in result.error
    assert message in result.error


def test_ar_to_dit_rejects_missing_tokens() -> None:
    with pytest.raises(EngineInputError, match="image_tokens"):
        ar_to_dit(StageData({"size": 64}))
