"""The qwen3-omni talker's continuous batching, driven as the engine core drives it
(``before_step`` once per step, then ``next()`` on every open stream): requests with prompts
of different lengths that join at different steps get, row for row, the codes each gets alone
and the codes of transformers' monolithic ``generate`` (sampled with the same seed, and greedy),
in one talker forward per step; an aborted row leaves the others' codes unchanged; a request
that fails (in its prefill or in a batched step) fails alone."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
import torch

from omni_mesh.engines.base import EngineRequest, StageData, StageEngine
from omni_mesh.engines.qwen3_omni.processors import thinker_to_talker
from tests.engines.batching.drive import Forwards, alone, codes, drive
from tests.engines.helpers import make_engine
from tests.engines.qwen3_omni import omni_reference
from tests.engines.qwen3_omni.omni_reference import CHATS

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

FRAMES = 24  # talker max_frames: 23 frames of codes per request


class Engines:
    def __init__(self) -> None:
        self.thinker = make_engine("qwen3-omni", 0)
        self.sampled = make_engine("qwen3-omni", 1, max_frames=FRAMES, chunk_frames=5)
        self.sampled.ctx = dataclasses.replace(self.sampled.ctx, async_chunk=True)
        self.greedy = make_engine("qwen3-omni", 1, max_frames=FRAMES, do_sample=False)
        self.inputs = [self.talker_input(messages, tokens) for messages, tokens in CHATS]

    def talker_input(self, messages: list[dict[str, Any]], tokens: int) -> StageData:
        fields = {"messages": json.dumps(messages), "max_tokens": tokens, "voice": "ethan"}
        (thought,) = self.thinker.execute([EngineRequest("t", 1, StageData(fields=fields))])
        assert thought.error is None
        return thinker_to_talker(thought.output)


@pytest.fixture(scope="module")
def engines() -> Engines:
    return Engines()


def test_rows_joining_at_different_steps_get_their_codes_alone_and_the_monolithic_ones(
    engines: Engines,
) -> None:
    talker = engines.sampled
    requests = [EngineRequest(f"r{i}", 40 + i, data) for i, data in enumerate(engines.inputs)]
    forwards = Forwards(talker.model.model)  # type: ignore[attr-defined]
    try:
        results, errors = drive(talker, {0: requests[:2], 3: [requests[2]], 7: [requests[3]]})
    finally:
        forwards.close()
    assert not errors
    lengths = {data.arrays["sequences"].shape[0] for data in engines.inputs}
    assert len(lengths) == len(CHATS)  # every prompt has its own length
    decodes = forwards.decodes
    assert len(forwards.prefills) == 4 and max(decodes) == 4  # one forward a step, every row
    assert decodes[:3] == [2, 2, 2] and decodes[7] == 4
    for i, request in enumerate(requests):
        got = codes(results[request.request_id])
        assert got.shape == (FRAMES - 1, 4)
        assert np.array_equal(got, alone(talker, request.data, request.seed)), i
        sizes = [len(r.output.arrays["codes"]) for r in results[request.request_id]]
        assert sizes == [2, 5, 5, 5, 5, 1]  # first_chunk_frames, then chunk_frames
    model = omni_reference.monolithic()
    for i in (1, 2):  # with audio input; the longest prompt, joined at step 3
        messages, tokens = CHATS[i]
        _, expected, _ = omni_reference.monolithic_codes(
            model, messages, seed=40 + i, max_tokens=tokens, frames=FRAMES, sample_talker=True
        )
        assert np.array_equal(codes(results[f"r{i}"]), expected), i
    assert not talker.batch.busy  # type: ignore[attr-defined]


def test_greedy_rows_batched_equal_the_monolithic_model(engines: Engines) -> None:
    talker = engines.greedy
    requests = [EngineRequest(f"g{i}", 1, data) for i, data in enumerate(engines.inputs)]
    forwards = Forwards(talker.model.model)  # type: ignore[attr-defined]
    try:
        together = talker.execute(requests)  # whole answers, still batched
    finally:
        forwards.close()
    assert max(rows for rows, _ in forwards.shapes) == 4
    model = omni_reference.monolithic()
    for i, (messages, tokens) in enumerate(CHATS):
        _, expected, _ = omni_reference.monolithic_codes(
            model, messages, seed=1, max_tokens=tokens, frames=FRAMES, sample_talker=False
        )
        assert together[i].error is None and together[i].last
        assert np.array_equal(together[i].output.arrays["codes"], expected), i


def test_whole_answers_join_the_batch_and_arrive_in_one_result(engines: Engines) -> None:
    talker = engines.greedy  # async_chunk off: every stream gives one whole result
    requests = [EngineRequest(f"w{i}", 1, data) for i, data in enumerate(engines.inputs[:3])]
    forwards = Forwards(talker.model.model)  # type: ignore[attr-defined]
    try:
        results, errors = drive(talker, {0: requests[:1], 2: requests[1:]})
    finally:
        forwards.close()
    assert not errors
    assert max(rows for rows, _ in forwards.shapes) == 3
    for request in requests:
        (result,) = results[request.request_id]
        assert result.last and "context_codes" not in result.output.arrays
        assert result.output.fields == {"num_frames": FRAMES - 1, "frame_offset": 0}
        assert np.array_equal(result.output.arrays["codes"], alone(talker, request.data, 1))


def test_an_aborted_row_leaves_the_others_codes_unchanged(engines: Engines) -> None:
    talker = engines.sampled
    requests = [EngineRequest(f"a{i}", 7 + i, data) for i, data in enumerate(engines.inputs)]
    results, errors = drive(talker, {0: requests[:3], 4: requests[3:]}, aborts={5: ["a1"]})
    assert not errors
    assert not results["a1"][-1].last  # its stream was closed mid-answer
    for request in (requests[0], requests[2], requests[3]):
        got = codes(results[request.request_id])
        assert np.array_equal(got, alone(talker, request.data, request.seed))
    assert not talker.batch.busy  # type: ignore[attr-defined]


def poisoned(data: StageData, *, from_position: int) -> StageData:
    """``data`` with huge (finite) thinker embeddings from ``from_position`` on: from
    ``prompt_tokens + 3``, the answer's trailing text from its third entry (the third decode
    step reads it); from 0, the prompt too."""
    embed = data.arrays["thinker_embed"].copy()
    embed[from_position:] = 3e38
    return StageData(fields=dict(data.fields), arrays={**data.arrays, "thinker_embed": embed})


class Tripwire:
    """A talker that fails on huge inputs (a kernel error for one request's data): a forward
    pre-hook on the MoE model raising when any row's input is beyond 1e30."""

    def __init__(self, engine: StageEngine) -> None:
        model = engine.model.model  # type: ignore[attr-defined]
        self._hook = model.register_forward_pre_hook(self._check, with_kwargs=True)

    @staticmethod
    def _check(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        x = kwargs["inputs_embeds"]
        if not bool(torch.isfinite(x).all()) or bool((x.abs() > 1e30).any()):
            raise FloatingPointError("input beyond the kernel's range")

    def close(self) -> None:
        self._hook.remove()


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_failing_request_fails_alone(engines: Engines, where: str) -> None:
    talker = engines.sampled
    good = [EngineRequest(f"ok{i}", 3 + i, data) for i, data in enumerate(engines.inputs[:3])]
    base = engines.inputs[0]
    start = int(base.fields["prompt_tokens"]) + 3 if where == "decode" else 0
    assert len(base.arrays["thinker_embed"]) > start
    bad = EngineRequest("bad", 9, poisoned(base, from_position=start))
    tripwire = Tripwire(talker)
    try:
        results, errors = drive(talker, {0: [good[0], bad], 2: good[1:]})
    finally:
        tripwire.close()
    assert set(errors) == {"bad"} and isinstance(errors["bad"], FloatingPointError)
    if where == "decode":  # its first chunk (2 frames, batched with ok0) came out before
        assert [len(r.output.arrays["codes"]) for r in results["bad"]] == [2]
    else:
        assert "bad" not in results
    for request in good:
        got = codes(results[request.request_id])
        assert np.array_equal(got, alone(talker, request.data, request.seed))
    assert not talker.batch.busy  # type: ignore[attr-defined]


def test_a_bad_input_fails_alone_with_a_message(engines: Engines) -> None:
    data = engines.inputs[0]
    sequences = data.arrays["sequences"].copy()
    sequences[: int(data.fields["prompt_tokens"])] = 0  # no assistant turn to speak
    bad = StageData(fields=dict(data.fields), arrays={**data.arrays, "sequences": sequences})
    results = engines.greedy.execute([EngineRequest("bad", 1, bad), EngineRequest("ok", 1, data)])
    assert results[0].error is not None
    assert "array 'sequences' has no assistant turn in its prompt" in results[0].error
    assert results[1].error is None
    assert np.array_equal(results[1].output.arrays["codes"], alone(engines.greedy, data, 1))
