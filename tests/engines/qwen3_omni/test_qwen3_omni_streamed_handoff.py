"""qwen3-omni's streamed thinker → talker hand-off, in-process through two engine cores as the
stage processes run them: the thinker's answer in chunks (``answer.AnswerChunks``) joins into
exactly the whole hand-off's input, and a talker fed those chunks while it runs (ahead of the
thinker, its row parked between chunks; beside a whole-input request in the same batch) makes
the codes of the whole hand-off; a chunk out of order or of another shape fails its request
alone with a message."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import numpy as np
import pytest

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.chunk_merge import merged_input
from omni_mesh.data_plane.messages import StageInput, StageOutput, transfer_key
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.core import EngineCore
from tests.engines.helpers import stage_core, step_inline

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

PIPELINE = get_pipeline("qwen3-omni")
FAR_FUTURE_MS = int((time.time() + 3600) * 1000)
MESSAGES = [{"role": "user", "content": "Say something about the weather today, please."}]


def core(stage_id: int, **extras: Any) -> EngineCore:
    return stage_core(PIPELINE.name, stage_id, **extras)


def step(c: EngineCore, *inputs: StageInput) -> list[StageOutput]:
    return step_inline(c, *inputs)


def thinker_input(request_id: str, tokens: int) -> StageInput:
    from omni_mesh.data_plane.messages import Payload

    fields = {"messages": json.dumps(MESSAGES), "max_tokens": tokens, "voice": "ethan"}
    return StageInput(
        pipeline=PIPELINE.name,
        request_id=request_id,
        stage_id=0,
        deadline_ms=FAR_FUTURE_MS,
        seed=11,
        payload=Payload(fields=fields),  # type: ignore[arg-type]
    )


def run_all(c: EngineCore, si: StageInput) -> list[StageOutput]:
    outputs = step(c, si)
    while c.running:
        outputs += step(c)
    return outputs


class Cores:
    def __init__(self) -> None:
        self.streamed = core(0, talker_chunk_tokens=2)
        self.whole = core(0, talker_chunk_tokens=0)
        self.talker = core(1, max_frames=20, chunk_frames=4)

    def talker_inputs(self, thinker: EngineCore, request_id: str, tokens: int) -> list[StageInput]:
        outputs = run_all(thinker, thinker_input(request_id, tokens))
        assert all(out.error is None for out in outputs)
        return [n for out in outputs for n in out.next]


@pytest.fixture(scope="module")
def cores() -> Cores:
    return Cores()


def codes(outputs: list[StageOutput]) -> np.ndarray:
    assert all(out.error is None for out in outputs), [o.error for o in outputs]
    parts = [array_from_tensor(out.next[0].payload.tensors["codes"]) for out in outputs]
    return np.concatenate(parts)


def test_the_chunks_join_into_the_whole_hand_off(cores: Cores) -> None:
    chunks = cores.talker_inputs(cores.streamed, "a", 12)
    (whole,) = cores.talker_inputs(cores.whole, "a", 12)
    assert len(chunks) > 3 and [c.chunk for c in chunks] == list(range(len(chunks)))
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    joined = merged_input(chunks, ShmReader())
    assert joined.payload.fields == whole.payload.fields
    assert set(joined.payload.tensors) == set(whole.payload.tensors)
    for name, t in whole.payload.tensors.items():
        want = array_from_tensor(t)
        got = array_from_tensor(joined.payload.tensors[name])
        assert got.dtype == want.dtype and np.array_equal(got, want), name


def streamed(si: StageInput) -> StageInput:
    return msgspec.structs.replace(si, stream_from="http://127.0.0.1:1")


def test_a_talker_fed_as_the_thinker_answers_makes_the_whole_hand_offs_codes(
    cores: Cores,
) -> None:
    chunks = cores.talker_inputs(cores.streamed, "b", 16)
    (whole,) = cores.talker_inputs(cores.whole, "b", 16)
    talker = cores.talker
    want = codes(run_all(talker, msgspec.structs.replace(whole, request_id="w")))
    # the streamed request and a whole one share the batch; one chunk arrives every 3 steps
    first = streamed(chunks[0])
    other = msgspec.structs.replace(whole, request_id="other")
    outputs = step(talker, first, other)
    later = chunks[1:]
    steps = 0
    parked = 0
    while talker.running:
        if later and steps % 3 == 2:
            talker.feed(transfer_key(first), later.pop(0), array_from_tensor)
        outputs += step(talker)
        parked += bool(talker.engine.batch.parked)  # type: ignore[attr-defined]
        steps += 1
    mine = [out for out in outputs if out.request_id == "b"]
    theirs = [out for out in outputs if out.request_id == "other"]
    assert parked > 0  # the talker got ahead of the thinker and waited
    assert [out.chunk for out in mine] == list(range(len(mine))) and mine[-1].last
    assert np.array_equal(codes(mine), want)
    assert np.array_equal(codes(theirs), want)


def test_chunks_that_arrive_before_the_request_runs_are_kept_for_it(cores: Cores) -> None:
    chunks = cores.talker_inputs(cores.streamed, "c", 8)
    (whole,) = cores.talker_inputs(cores.whole, "c", 8)
    talker = cores.talker
    want = codes(run_all(talker, msgspec.structs.replace(whole, request_id="w2")))
    first = streamed(chunks[0])
    for chunk in chunks[1:]:  # every later chunk comes while the request is still queued
        talker.feed(transfer_key(first), chunk, array_from_tensor, queued=True)
    talker.feed("gone", chunks[1], array_from_tensor)  # a request not here: dropped
    assert "gone" not in talker._early
    got = run_all(talker, first)
    assert np.array_equal(codes(got), want)


def test_a_chunk_out_of_order_or_of_another_shape_fails_its_request_alone(
    cores: Cores,
) -> None:
    chunks = cores.talker_inputs(cores.streamed, "d", 10)
    talker = cores.talker
    first = streamed(chunks[0])
    outputs = step(talker, first)
    talker.feed(transfer_key(first), chunks[2], array_from_tensor)  # chunk 1 never came
    while talker.running:
        outputs += step(talker)
    assert outputs[-1].error is not None and outputs[-1].error.code == "bad_input"
    assert "chunk 2 came where chunk 1 was due" in outputs[-1].error.message

    bad = chunks[1]
    embed = array_from_tensor(bad.payload.tensors["thinker_embed"])
    tensors = dict(bad.payload.tensors)
    tensors["thinker_embed"] = tensor_from_array(np.zeros((1, embed.shape[1] + 1), np.float32))
    bad = msgspec.structs.replace(
        bad, payload=msgspec.structs.replace(bad.payload, tensors=tensors)
    )
    first = streamed(msgspec.structs.replace(chunks[0], request_id="e"))
    outputs = step(talker, first)
    talker.feed("e", msgspec.structs.replace(bad, request_id="e"), array_from_tensor)
    while talker.running:
        outputs += step(talker)
    assert outputs[-1].error is not None and outputs[-1].error.code == "bad_input"
    assert "'thinker_embed'" in outputs[-1].error.message


def test_a_chunk_alone_at_a_streamed_stage_or_a_stream_elsewhere_is_refused(cores: Cores) -> None:
    chunks = cores.talker_inputs(cores.streamed, "f", 8)
    (out,) = step(cores.talker, chunks[1])  # a later chunk as a request of its own
    assert out.error is not None and out.error.code == "bad_input"
    assert "came alone (no stream_from)" in out.error.message
    opening = msgspec.structs.replace(thinker_input("g", 4), last=False, stream_from="http://x:1")
    (out,) = step(cores.whole, opening)  # the thinker takes no streamed input
    assert out.error is not None and out.error.code == "bad_input"
    assert "stage 0 (thinker) takes no streamed input" in out.error.message
