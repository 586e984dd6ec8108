"""The glm-image AR runs every request it holds as a row of one batched step: rows of different
sizes and prompts, joining at different steps or leaving early (an abort), each get the prior
tokens of their lone run, which are diffusers' ``generate_prior_tokens`` for the same seed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Payload, StageInput, StageOutput
from omni_mesh.data_plane.tensors import array_from_tensor
from omni_mesh.engines.base import EngineRequest, StageData, StageEngine
from omni_mesh.engines.core import EngineCore
from tests.engines.glm_image import glm_reference
from tests.engines.helpers import make_engine, stage_core, step_inline

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

FAR_FUTURE_MS = 4_102_444_800_000  # 2100-01-01
#: (seed, prompt, width, height): four sizes, so four prompt lengths and decode lengths
REQUESTS = [
    (1, "a red fox", 32, 32),
    (2, "a shop sign that says 'BREAD'", 96, 64),
    (3, "mountains at dawn", 64, 96),
    (4, "a cat", 128, 128),
]


@pytest.fixture(scope="module")
def ar() -> StageEngine:
    return make_engine("glm-image", 0)


@pytest.fixture(scope="module")
def lone(ar: StageEngine) -> dict[int, np.ndarray]:
    """Each request's grid, run alone."""
    grids = {}
    for seed, prompt, width, height in REQUESTS:
        fields = {"prompt": prompt, "width": width, "height": height}
        (result,) = ar.execute([EngineRequest(f"lone-{seed}", seed, StageData(fields=fields))])
        assert result.error is None, result.error
        grids[seed] = result.output.arrays["prior_token_ids"]
    return grids


def test_lone_grids_are_the_pipelines(lone: dict[int, np.ndarray]) -> None:
    pipe = glm_reference.monolithic()
    for seed, prompt, width, height in REQUESTS:
        generator = torch.Generator().manual_seed(seed)
        ids, _, _ = pipe.generate_prior_tokens(prompt, height, width, generator=generator)
        grid = torch.from_numpy(lone[seed])
        assert torch.equal(pipe._upsample_token_ids(grid.reshape(-1), *grid.shape), ids), seed


def test_rows_of_every_size_in_one_batch_get_their_lone_tokens(
    ar: StageEngine, lone: dict[int, np.ndarray]
) -> None:
    batch = [
        EngineRequest(f"b-{seed}", seed, StageData(fields={"prompt": p, "width": w, "height": h}))
        for seed, p, w, h in REQUESTS
    ]
    results = ar.execute(batch)
    assert [r.request_id for r in results] == [r.request_id for r in batch]
    for (seed, *_), result in zip(REQUESTS, results, strict=True):
        assert result.error is None, result.error
        assert np.array_equal(result.output.arrays["prior_token_ids"], lone[seed]), seed


def _entry(request_id: str, seed: int, prompt: str, width: int, height: int) -> StageInput:
    fields = {"prompt": prompt, "width": width, "height": height}
    return StageInput(
        pipeline="glm-image",
        request_id=request_id,
        stage_id=0,
        deadline_ms=FAR_FUTURE_MS,
        seed=seed,
        payload=Payload(fields=fields),  # type: ignore[arg-type]
    )


def _grids(outputs: list[StageOutput]) -> dict[str, np.ndarray]:
    grids = {}
    for out in outputs:
        assert out.error is None, out.error
        (hop,) = out.next
        grids[out.request_id] = array_from_tensor(hop.payload.tensors["prior_token_ids"])
    return grids


def test_rows_joining_at_different_steps_get_their_lone_tokens(
    lone: dict[int, np.ndarray],
) -> None:
    """Through the engine core, as the engine process steps it: a request joins every 40 steps
    (the first has made 80 tokens when the third joins), all run to their ends together."""
    assert get_pipeline("glm-image").stage(0).name == "ar"
    core: EngineCore = stage_core("glm-image", 0)
    outputs: list[StageOutput] = []
    for i, (seed, prompt, width, height) in enumerate(REQUESTS):
        outputs += step_inline(core, _entry(f"j-{seed}", seed, prompt, width, height))
        for _ in range(39 if i + 1 < len(REQUESTS) else 0):
            outputs += step_inline(core)
        assert core.running == i + 1  # nobody has finished: the shortest needs 261 tokens
    while core.running:
        outputs += step_inline(core)
    grids = _grids(outputs)
    assert set(grids) == {f"j-{seed}" for seed, *_ in REQUESTS}
    for seed, *_ in REQUESTS:
        assert np.array_equal(grids[f"j-{seed}"], lone[seed]), seed


def test_a_row_that_leaves_early_leaves_the_others_their_tokens(
    ar: StageEngine, lone: dict[int, np.ndarray]
) -> None:
    requests = [
        EngineRequest(f"a-{seed}", seed, StageData(fields={"prompt": p, "width": w, "height": h}))
        for seed, p, w, h in REQUESTS[:3]
    ]
    streams: list[Any] = list(ar.open(requests))
    results: dict[str, Any] = {}
    for step in range(400):
        ar.before_step(len(streams))
        if step == 30:
            streams[1].close()  # an abort: its row leaves the batch
        for request, stream in zip(requests, streams, strict=True):
            if request.request_id in results or (request is requests[1] and step >= 30):
                continue
            result = next(stream)
            if result is not None:
                results[request.request_id] = result
        if len(results) == 2:
            break
    assert set(results) == {"a-1", "a-3"}
    assert not ar.batch.busy  # type: ignore[attr-defined]  # the aborted row left too
    for seed in (1, 3):
        grid = results[f"a-{seed}"].output.arrays["prior_token_ids"]
        assert np.array_equal(grid, lone[seed]), seed
