"""The glm-image DiT runs one denoising step per ``next()`` of a request's stream: the core's
requests take turns at step boundaries and each still gets the image of its lone run (the
pipeline's), and a cancel stops a request within one step (no DiT forward after it). With
``batch_steps`` the requests of one shape share each step's forwards, their images within
2 levels of their lone ones (measured: at most 1, in under 0.01 % of the pixels)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from omni_mesh.data_plane.messages import Payload, StageInput
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.glm_image.processors import ar_to_dit
from tests.engines.glm_image import glm_reference
from tests.engines.helpers import make_engine, stage_core, step_inline

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

STEPS = 5
FAR_FUTURE_MS = 4_102_444_800_000  # 2100-01-01
PROMPTS = [(7, "a 'tiny' lighthouse", 64, 64), (8, "a red door", 64, 64), (9, "waves", 96, 32)]


class Stages:
    def __init__(self) -> None:
        self.ar = make_engine("glm-image", 0)
        self.dit = make_engine("glm-image", 1, steps=STEPS)
        self.inputs: dict[int, StageData] = {}
        for seed, prompt, width, height in PROMPTS:
            fields = {"prompt": prompt, "width": width, "height": height}
            (ar,) = self.ar.execute([EngineRequest(f"ar-{seed}", seed, StageData(fields))])
            assert ar.error is None, ar.error
            self.inputs[seed] = ar_to_dit(ar.output)


@pytest.fixture(scope="module")
def stages() -> Stages:
    return Stages()


@pytest.fixture(scope="module")
def pipeline_images() -> dict[int, np.ndarray]:
    pipe = glm_reference.monolithic()
    return {
        seed: glm_reference.pipeline_pixels(pipe, prompt, seed, width, height, STEPS, 1.5)
        for seed, prompt, width, height in PROMPTS
    }


def _image(result: EngineResult | None) -> np.ndarray:
    assert result is not None and result.error is None, result
    assert result.final is not None
    return result.final.arrays["image"]


def test_a_stream_takes_one_step_per_next(
    stages: Stages, pipeline_images: dict[int, np.ndarray]
) -> None:
    seed = PROMPTS[0][0]
    (stream,) = stages.dit.open([EngineRequest("s", seed, stages.inputs[seed])])
    items = list(stream)
    assert items[:-1] == [None] * (STEPS - 1)
    assert np.array_equal(_image(items[-1]), pipeline_images[seed])


def test_streams_taking_turns_get_their_lone_images(
    stages: Stages, pipeline_images: dict[int, np.ndarray]
) -> None:
    """Three requests opened two steps apart, advanced in turn as the core does."""
    dit = stages.dit
    streams: dict[int, Iterator[EngineResult | None]] = {}
    images: dict[int, np.ndarray] = {}
    for step in range(3 * STEPS):
        if step % 2 == 0 and len(streams) < len(PROMPTS):
            seed = PROMPTS[len(streams)][0]
            (streams[seed],) = dit.open([EngineRequest(f"t{seed}", seed, stages.inputs[seed])])
        for seed, stream in streams.items():
            if seed not in images and (result := next(stream)) is not None:
                images[seed] = _image(result)
    assert set(images) == {seed for seed, *_ in PROMPTS}
    for seed, image in images.items():
        assert np.array_equal(image, pipeline_images[seed]), seed


def _dit_input(stages: Stages, request_id: str, seed: int) -> StageInput:
    """The DiT's input for ``seed`` as the AR's hop carries it."""
    data = stages.inputs[seed]
    tensors = {name: tensor_from_array(array) for name, array in data.arrays.items()}
    return StageInput(
        pipeline="glm-image",
        request_id=request_id,
        stage_id=1,
        from_stage=0,
        deadline_ms=FAR_FUTURE_MS,
        seed=seed,
        payload=Payload(fields=data.fields, tensors=tensors),  # type: ignore[arg-type]
    )


def test_a_cancel_stops_the_request_within_one_step(
    stages: Stages, pipeline_images: dict[int, np.ndarray]
) -> None:
    core = stage_core("glm-image", 1, steps=STEPS)
    forwards: list[int] = []
    model = core.engine.model  # type: ignore[attr-defined]
    handle = model.register_forward_hook(lambda module, args, out: forwards.append(1))
    try:
        (seed_a, *_), (seed_b, *_) = PROMPTS[:2]
        cancelled = _dit_input(stages, "cancelled", seed_a)
        kept = _dit_input(stages, "kept", seed_b)
        assert step_inline(core, cancelled, kept) == []  # one step each, no image yet
        assert step_inline(core) == []
        per_step = 2  # the conditional and the unconditional forward (guidance 1.5)
        assert len(forwards) == 2 * 2 * per_step
        assert core.abort("cancelled") is not None
        outputs = []
        while core.running:
            outputs += step_inline(core)
        (out,) = outputs
        assert out.request_id == "kept" and out.error is None and out.final is not None
        image = array_from_tensor(out.final.tensors["image"])
        assert np.array_equal(image, pipeline_images[seed_b])
        # the cancelled request ran no forward after its cancel
        assert len(forwards) == (2 * 2 + (STEPS - 2)) * per_step
    finally:
        handle.remove()


#: Two requests of one shape (64 x 64, no quoted text: equal glyph lengths) and one of another.
BATCHED = [(8, "a red door", 64, 64), (10, "a green hill", 64, 64), (9, "waves", 96, 32)]


def test_batched_steps_share_forwards_and_stay_near_their_lone_images(stages: Stages) -> None:
    """With ``batch_steps``, driven as the core drives it (``before_step``, then one ``next()``
    per stream): the two 64 x 64 requests take each step in shared forwards, the other alone
    (its image then equal to its lone one); the shared ones' images within a few levels of
    theirs."""
    dit = make_engine("glm-image", 1, steps=STEPS, batch_steps=True)
    lone = {}
    for seed, prompt, width, height in BATCHED:
        fields = {"prompt": prompt, "width": width, "height": height}
        (ar,) = stages.ar.execute([EngineRequest(f"ar-{seed}", seed, StageData(fields))])
        stages.inputs[seed] = ar_to_dit(ar.output)
        (alone,) = stages.dit.execute([EngineRequest(f"lone-{seed}", seed, stages.inputs[seed])])
        lone[seed] = _image(alone)
    rows: list[int] = []  # the rows of every DiT forward
    handle = dit.model.register_forward_hook(  # type: ignore[attr-defined]
        lambda module, args, kwargs, out: rows.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )
    try:
        requests = [EngineRequest(f"b{seed}", seed, stages.inputs[seed]) for seed, *_ in BATCHED]
        streams = dit.open(requests)
        images: dict[int, np.ndarray] = {}
        while len(images) < len(BATCHED):
            dit.before_step(len(streams))
            for (seed, *_), stream in zip(BATCHED, streams, strict=True):
                if seed not in images and (result := next(stream)) is not None:
                    images[seed] = _image(result)
    finally:
        handle.remove()
    assert not dit.jobs  # type: ignore[attr-defined]
    # the first step of each alone (its stream starts it), then per step: the pair in two
    # forwards of 2 rows (conditional, unconditional), the other in two of 1
    assert sorted(rows) == sorted([1] * 3 * 2 + ([2, 2, 1, 1]) * (STEPS - 1))
    assert np.array_equal(images[9], lone[9])  # alone in its shape: its lone computation
    for seed in (8, 10):
        diff = np.abs(images[seed].astype(int) - lone[seed].astype(int))
        assert diff.max() <= 2 and (diff > 0).mean() < 0.01, (seed, diff.max())
