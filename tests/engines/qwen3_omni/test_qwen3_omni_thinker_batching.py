"""The qwen3-omni thinker's continuous batching, driven as the engine core drives it
(``before_step`` once per step, then ``next()`` on every open stream): requests with prompts of
different lengths (one with audio input) that join at different steps get, row for row, the
tokens each gets alone and the tokens of transformers' ``thinker.generate`` after
``torch.manual_seed(seed)`` (greedy and sampled), in one thinker forward per step; their text
streams token by token; an aborted row leaves the others unchanged; a request that fails (in
its prefill or in a batched step) fails alone.

The talker's inputs (``thinker_embed``, ``thinker_hidden``) batched are within :data:`ATOL` of
those alone: measured on tiny-qwen3-omni (these four rows, greedy and sampled), the input
embeddings are bit for bit the same and the accept layer's hidden states (values up to 0.084)
moved by at most 1.2e-8; the closest top-two logits of any step were 0.038 apart, so no token
choice is near a float tie.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
import torch

from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.engines.base import EngineRequest, EngineResult, StageData, StageEngine
from tests.engines.batching.drive import Forwards, drive
from tests.engines.helpers import make_engine
from tests.engines.qwen3_omni import omni_reference
from tests.engines.qwen3_omni.omni_reference import CHATS

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

ATOL = 1e-6  # batched vs alone, thinker_embed and thinker_hidden (module docstring)
ARRAYS = ("thinker_embed", "thinker_hidden")
SAMPLED = SamplingParams(temperature=1.3)


class Engines:
    def __init__(self) -> None:
        self.whole = make_engine("qwen3-omni", 0)
        self.streaming = make_engine("qwen3-omni", 0)
        self.streaming.ctx = dataclasses.replace(self.streaming.ctx, async_chunk=True)


@pytest.fixture(scope="module")
def engines() -> Engines:
    return Engines()


def chat(messages: list[dict[str, Any]], max_tokens: int) -> StageData:
    return StageData(fields={"messages": json.dumps(messages), "max_tokens": max_tokens})


def requests(prefix: str, seed: int, sampling: SamplingParams | None) -> list[EngineRequest]:
    return [
        EngineRequest(f"{prefix}{i}", seed + i, chat(messages, tokens), sampling)
        for i, (messages, tokens) in enumerate(CHATS)
    ]


def alone(engine: StageEngine, request: EngineRequest) -> EngineResult:
    (result,) = engine.execute([request])
    assert result.error is None, result.error
    return result


def prompt_tokens(result: EngineResult) -> int:
    tokens = result.output.fields["prompt_tokens"]
    assert isinstance(tokens, int)
    return tokens


def assert_same(got: EngineResult, want: EngineResult) -> None:
    """The same tokens, text and usage; the hidden-state arrays within ATOL."""
    assert got.error is None and got.output is not None and want.output is not None
    for name, arr in want.output.arrays.items():
        if name in ARRAYS:
            assert got.output.arrays[name].shape == arr.shape, name
            assert float(np.abs(got.output.arrays[name] - arr).max()) <= ATOL, name
        else:
            assert np.array_equal(got.output.arrays[name], arr), name
    assert got.output.fields == want.output.fields


def generate(model: Any, messages: list[dict[str, Any]], seed: int, max_tokens: int) -> Any:
    """transformers' ``thinker.generate`` after ``torch.manual_seed(seed)``, sampled as
    :data:`SAMPLED` asks (its sequences and hidden states)."""
    prompt, extra = omni_reference.reference_prompt(model, messages)
    torch.manual_seed(seed)
    with torch.inference_mode():
        return model.thinker.generate(
            input_ids=prompt.input_ids,
            attention_mask=prompt.attention_mask,
            max_new_tokens=max_tokens,
            eos_token_id=model.config.im_end_token_id,
            do_sample=True,
            temperature=SAMPLED.temperature,
            top_p=1.0,
            top_k=0,
            output_hidden_states=True,
            return_dict_in_generate=True,
            **extra,
        )


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_rows_joining_at_different_steps_get_their_answers_alone(
    engines: Engines, sampling: SamplingParams | None
) -> None:
    thinker = engines.streaming
    batch = requests("r", 40, sampling)
    forwards = Forwards(thinker.model.model)  # type: ignore[attr-defined]
    try:
        results, errors = drive(thinker, {0: batch[:2], 2: [batch[2]], 4: [batch[3]]})
    finally:
        forwards.close()
    assert not errors
    lengths = {prompt_tokens(results[r.request_id][-1]) for r in batch}
    assert len(lengths) == len(CHATS)  # every prompt has its own length
    assert len(forwards.prefills) == 4  # each alone, its first token; then one forward a step
    assert forwards.decodes[:5] == [2, 2, 3, 3, 4]  # a row prefilled at step k decodes from k+1
    for request in batch:
        chunks = results[request.request_id]
        whole = alone(engines.whole, request)
        assert_same(chunks[-1], whole)
        assert all(not c.forward and not c.last and not c.output.arrays for c in chunks[:-1])
        assert chunks[-1].last and chunks[-1].forward
        texts = [str(c.final.fields["text"]) for c in chunks if c.final is not None]
        assert whole.final is not None and "".join(texts) == whole.final.fields["text"]
        assert len(chunks) >= 2  # text came before the whole answer
    assert not thinker.batch.busy  # type: ignore[attr-defined]


def test_sampled_rows_batched_equal_the_thinkers_generate(engines: Engines) -> None:
    batch = requests("s", 60, SAMPLED)
    together = engines.whole.execute(batch)  # whole answers, still batched
    model = omni_reference.monolithic()
    layer = model.config.talker_config.accept_hidden_layer
    for i in (1, 2):  # with audio input; the longest prompt
        messages, tokens = CHATS[i]
        expected = generate(model, messages, 60 + i, tokens)
        got = together[i].output.arrays
        assert np.array_equal(got["sequences"], expected.sequences[0].numpy()), i
        for name, index in zip(ARRAYS, (0, layer), strict=True):
            want = torch.cat([h[index] for h in expected.hidden_states], dim=1)[0].numpy()
            assert float(np.abs(got[name] - want).max()) <= ATOL, (i, name)


def test_an_aborted_row_leaves_the_others_unchanged(engines: Engines) -> None:
    thinker = engines.streaming
    batch = requests("a", 7, SAMPLED)
    results, errors = drive(thinker, {0: batch[:3], 2: batch[3:]}, aborts={3: ["a2"]})
    assert not errors
    assert not results["a2"][-1].last  # its stream was closed mid-answer
    for request in (batch[0], batch[1], batch[3]):
        assert_same(results[request.request_id][-1], alone(engines.whole, request))
    assert not thinker.batch.busy  # type: ignore[attr-defined]


class Tripwire:
    """A thinker that fails at text positions from ``limit`` on (a kernel error for one
    request's data): a forward pre-hook on the MoE LM."""

    def __init__(self, engine: StageEngine, limit: int) -> None:
        self.limit = limit
        model = engine.model.model  # type: ignore[attr-defined]
        self._hook = model.register_forward_pre_hook(self._check, with_kwargs=True)

    def _check(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if int(kwargs["position_ids"][0].max()) >= self.limit:
            raise FloatingPointError("position beyond the kernel's range")

    def close(self) -> None:
        self._hook.remove()


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_failing_request_fails_alone(engines: Engines, where: str) -> None:
    thinker = engines.streaming
    good = requests("ok", 3, SAMPLED)
    good = [good[0], good[1], good[3]]  # prompts and answers shorter than the bad one's prompt
    messages, _ = CHATS[2]
    bad = EngineRequest("bad", 9, chat(messages, 10), SAMPLED)
    prompt = prompt_tokens(alone(engines.whole, bad))
    assert all(
        int(alone(engines.whole, r).output.arrays["sequences"].shape[0]) < prompt - 1 for r in good
    )
    limit = prompt - 1 if where == "prefill" else prompt + 2  # its third decode fails
    tripwire = Tripwire(thinker, limit)
    try:
        results, errors = drive(thinker, {0: [good[0], bad], 2: good[1:]})
    finally:
        tripwire.close()
    assert set(errors) == {"bad"} and isinstance(errors["bad"], FloatingPointError)
    if where == "decode":  # its first three tokens' text came out before
        assert 1 <= len(results.get("bad", [])) <= 3
    else:
        assert "bad" not in results
    for request in good:
        assert_same(results[request.request_id][-1], alone(engines.whole, request))
    assert not thinker.batch.busy  # type: ignore[attr-defined]
