"""The csm-tts talker's continuous batching, driven as the engine core drives it
(``before_step`` once per step, then ``next()`` on every open stream): requests with prompts of
different lengths and frame caps that join at different steps get, row for row, the codes each
gets alone and the codes of transformers' monolithic ``generate`` (sampled with the same seed,
and greedy), in one backbone forward per step; an aborted row leaves the others' codes
unchanged; a request whose prefill fails fails alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from omni_mesh.engines.base import EngineRequest, StageData, StageEngine
from tests.engines.batching.drive import Forwards, alone, codes, drive
from tests.engines.csm import csm_reference
from tests.engines.helpers import make_engine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

FRAMES = 20  # talker max_frames
#: (text, voice, max_tokens): prompts of different lengths, caps of different sizes
SPEECHES = [
    ("hello there", "0", 20),
    ("the quick brown fox jumps over the lazy dog", "1", 9),
    ("a much longer sentence, spoken by the first voice, to make a long prompt", "0", 14),
    ("hi", "1", 20),
]


def speech(text: str, voice: str, frames: int) -> StageData:
    return StageData(fields={"prompt": text, "voice": voice, "max_tokens": frames})


class Engines:
    def __init__(self) -> None:
        self.sampled = make_engine("csm-tts", 0, max_frames=FRAMES, chunk_frames=4)
        self.sampled.ctx = dataclasses.replace(self.sampled.ctx, async_chunk=True)
        self.greedy = make_engine("csm-tts", 0, max_frames=FRAMES, do_sample=False)
        self.inputs = [speech(*s) for s in SPEECHES]

    @staticmethod
    def backbone(engine: StageEngine) -> Any:
        return engine.model.backbone_model  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def engines() -> Engines:
    return Engines()


def test_rows_joining_at_different_steps_get_their_codes_alone_and_the_monolithic_ones(
    engines: Engines,
) -> None:
    talker = engines.sampled
    requests = [EngineRequest(f"r{i}", 30 + i, data) for i, data in enumerate(engines.inputs)]
    forwards = Forwards(engines.backbone(talker))
    try:
        results, errors = drive(talker, {0: requests[:2], 3: [requests[2]], 5: [requests[3]]})
    finally:
        forwards.close()
    assert not errors
    assert len(set(forwards.prefills)) == 4  # every prompt has its own length
    decodes = forwards.decodes
    assert decodes[:3] == [2, 2, 2] and max(decodes) == 4  # one forward a step, every row
    for i, (request, (text, voice, frames)) in enumerate(zip(requests, SPEECHES, strict=True)):
        got = codes(results[request.request_id])
        assert got.shape == (frames, 8)
        assert np.array_equal(got, alone(talker, request.data, request.seed)), i
        expected, _ = csm_reference.generate(
            text, speaker=int(voice), seed=request.seed, frames=frames, sampled=True
        )
        assert np.array_equal(got, expected), i
    assert not talker.batch.busy  # type: ignore[attr-defined]


def test_greedy_rows_batched_equal_the_monolithic_model(engines: Engines) -> None:
    talker = engines.greedy
    requests = [EngineRequest(f"g{i}", 1, data) for i, data in enumerate(engines.inputs)]
    forwards = Forwards(engines.backbone(talker))
    try:
        together = talker.execute(requests)
    finally:
        forwards.close()
    assert max(forwards.decodes) == 4
    for i, (text, voice, frames) in enumerate(SPEECHES):
        expected, _ = csm_reference.generate(
            text, speaker=int(voice), seed=1, frames=frames, sampled=False
        )
        assert together[i].error is None
        assert np.array_equal(together[i].output.arrays["codes"], expected), i


def test_an_aborted_row_leaves_the_others_codes_unchanged(engines: Engines) -> None:
    talker = engines.sampled
    requests = [EngineRequest(f"a{i}", 7 + i, data) for i, data in enumerate(engines.inputs)]
    results, errors = drive(talker, {0: requests[:3], 2: requests[3:]}, aborts={4: ["a0"]})
    assert not errors
    assert not results["a0"][-1].last  # its stream was closed mid-answer
    for request in requests[1:]:
        got = codes(results[request.request_id])
        assert np.array_equal(got, alone(talker, request.data, request.seed))
    assert not talker.batch.busy  # type: ignore[attr-defined]


def test_a_request_whose_prefill_fails_fails_alone(engines: Engines) -> None:
    talker = engines.sampled
    bad_text = "this prompt trips the kernel, and only this one, however long it goes on and on"
    bad = EngineRequest("bad", 2, speech(bad_text, "0", 10))
    good = [EngineRequest(f"ok{i}", 3 + i, data) for i, data in enumerate(engines.inputs[:3])]
    lengths = [len(talker.parse(r).input_ids) for r in (bad, *good)]  # type: ignore[attr-defined]
    bad_length = lengths[0]
    assert bad_length not in lengths[1:]

    def trip(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs["inputs_embeds"].shape[1] == bad_length:
            raise FloatingPointError("prompt beyond the kernel's range")

    hook = engines.backbone(talker).register_forward_pre_hook(trip, with_kwargs=True)
    try:
        results, errors = drive(talker, {0: [good[0], bad], 2: good[1:]})
    finally:
        hook.remove()
    assert set(errors) == {"bad"} and isinstance(errors["bad"], FloatingPointError)
    for request in good:
        got = codes(results[request.request_id])
        assert np.array_equal(got, alone(talker, request.data, request.seed))
    assert not talker.batch.busy  # type: ignore[attr-defined]
