"""Bad input to the glm-image stages fails its request alone, before any compute, with a message
naming the stage and the field; the engines keep serving."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omni_mesh.engines.base import EngineInputError, EngineRequest, StageData, StageEngine
from omni_mesh.engines.glm_image.processors import ar_to_dit
from tests.engines.helpers import make_engine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def ar() -> StageEngine:
    return make_engine("glm-image", 0, max_size=256)


@pytest.fixture(scope="module")
def dit() -> StageEngine:
    return make_engine("glm-image", 1, steps=1)


def error_of(engine: StageEngine, fields: dict[str, Any], seed: Any = 1, **arrays: Any) -> str:
    request = EngineRequest("bad", seed, StageData(fields=fields, arrays=arrays))
    (result,) = engine.execute([request])
    assert result.error is not None
    return result.error


@pytest.mark.parametrize(
    ("fields", "seed", "named", "says"),
    [
        ({"prompt": "x", "size": 48}, 1, "'size'", "multiple of 32"),
        ({"prompt": "x", "size": 16}, 1, "'size'", "[32, 256]"),
        ({"prompt": "x", "size": 288}, 1, "'size'", "[32, 256]"),  # over max_size
        ({"prompt": "x", "size": "64"}, 1, "'size'", "must be an integer"),
        ({"prompt": "x", "width": 64}, 1, "'height'", "is required"),
        ({"prompt": "x", "width": 64, "height": 100}, 1, "'height'", "multiple of 32"),
        ({"prompt": "x", "width": True, "height": 64}, 1, "'width'", "must be an integer"),
        ({"size": 64}, 1, "'prompt'", "is required"),
        ({"prompt": "", "size": 64}, 1, "'prompt'", "must not be empty"),
        ({"prompt": 3, "size": 64}, 1, "'prompt'", "must be a string"),
        ({"prompt": "x", "size": 64}, "7", "'seed'", "must be an integer"),
        ({"prompt": "x", "size": 64}, 1.5, "'seed'", "must be an integer"),
        ({"prompt": "x", "size": 64}, -1, "'seed'", "[0, 2**64)"),
        ({"prompt": "x", "size": 64}, 1 << 64, "'seed'", "[0, 2**64)"),
    ],
)
def test_bad_ar_input_names_the_field(
    ar: StageEngine, fields: dict[str, Any], seed: Any, named: str, says: str
) -> None:
    message = error_of(ar, fields, seed)
    assert "stage 'ar' (glm-image stage 0)" in message and named in message, message
    assert says in message, message


GRID = np.zeros((2, 2), np.int64)


@pytest.mark.parametrize(
    ("fields", "arrays", "named", "says"),
    [
        ({"width": 64, "height": 64}, {"prior_token_ids": GRID}, "'prompt'", "is required"),
        ({"prompt": "x"}, {"prior_token_ids": GRID}, "'size'", "is required"),  # no default
        ({"prompt": "x", "height": 64}, {"prior_token_ids": GRID}, "'width'", "is required"),
        ({"prompt": "x", "width": 64, "height": 64}, {}, "'prior_token_ids'", "is required"),
        (
            {"prompt": "x", "width": 96, "height": 64},
            {"prior_token_ids": GRID},
            "'prior_token_ids'",
            "shape (2, 3)",
        ),
        (
            {"prompt": "x", "width": 64, "height": 64},
            {"prior_token_ids": GRID.astype(np.int32)},
            "'prior_token_ids'",
            "must be int64",
        ),
        (
            {"prompt": "x", "width": 64, "height": 64},
            {"prior_token_ids": GRID + 128},  # the tiny DiT's codebook holds 128 ids
            "'prior_token_ids'",
            "ids in [0, 128)",
        ),
        (
            {"prompt": "x", "width": 64, "height": 64, "steps": 0},
            {"prior_token_ids": GRID},
            "'steps'",
            "[1, 200]",
        ),
        (
            {"prompt": "x", "width": 64, "height": 64, "guidance_scale": "high"},
            {"prior_token_ids": GRID},
            "'guidance_scale'",
            "must be a number",
        ),
    ],
)
def test_bad_dit_input_names_the_field(
    dit: StageEngine, fields: dict[str, Any], arrays: dict[str, Any], named: str, says: str
) -> None:
    message = error_of(dit, fields, 1, **arrays)
    assert "stage 'dit' (glm-image stage 1)" in message and named in message, message
    assert says in message, message


def test_a_bad_request_fails_alone(ar: StageEngine) -> None:
    good = EngineRequest("good", 3, StageData(fields={"prompt": "a cat", "size": 32}))
    bad = EngineRequest("bad", 3, StageData(fields={"prompt": "a cat", "size": 40}))
    results = {r.request_id: r for r in ar.execute([bad, good])}
    assert results["bad"].error is not None and results["good"].error is None
    assert results["good"].output.arrays["prior_token_ids"].shape == (1, 1)


def test_the_processor_names_what_the_ar_left_out() -> None:
    with pytest.raises(EngineInputError, match="prior_token_ids"):
        ar_to_dit(StageData(fields={"prompt": "x", "width": 64, "height": 64}))
    with pytest.raises(EngineInputError, match="'height'"):
        ar_to_dit(StageData(fields={"prompt": "x", "width": 64}, arrays={"prior_token_ids": GRID}))
