"""The OpenAI text routes' shared pieces: sampling params only where the request sets them (the
stage's defaults apply to the rest), a bad value a 400 naming the field, and ``finish_reason`` /
``usage`` / logprobs read from the text stage's final fields (absent: ``stop``, zeros)."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from omni_mesh.configs.pipeline_spec import OutputKind
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Prompt, SamplingParams, Scalar
from omni_mesh.data_plane.tensors import payload_from_arrays
from omni_mesh.sidecar.api.chat_answer import chat_completion
from omni_mesh.sidecar.api.choices import choice_prompts
from omni_mesh.sidecar.api.completions import CompletionAnswer
from omni_mesh.sidecar.api.openai_text import finish_reason, sampling_from, usage, usage_of
from omni_mesh.sidecar.api.openai_types import ChatRequest, CompletionRequest
from omni_mesh.sidecar.api.outputs import FinalOutput, final_output, join_outputs
from omni_mesh.sidecar.api.text_logprobs import TokenLogprobs
from omni_mesh.sidecar.errors import ApiError

PIPELINE = get_pipeline("tiny-llm")

pytestmark = pytest.mark.unit


def completion(**fields: object) -> CompletionRequest:
    return msgspec.convert({"model": "m", "prompt": "p", **fields}, CompletionRequest)


def test_nothing_set_is_no_sampling_params() -> None:
    assert sampling_from(completion(), max_tokens=None, logprobs=None) is None


def test_only_what_the_request_sets() -> None:
    req = completion(top_p=0.5, stop="END", ignore_eos=True)
    got = sampling_from(req, max_tokens=7, logprobs=0)
    assert got == SamplingParams(top_p=0.5, stop=["END"], max_tokens=7, logprobs=0, ignore_eos=True)
    assert got is not None and got.temperature is None  # the stage's default applies


@pytest.mark.parametrize(("stop", "field"), [([""], "stop"), (["x"] * 17, "stop")])
def test_a_bad_value_is_a_400_naming_the_field(stop: list[str], field: str) -> None:
    chat = msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["ok"]}, ChatRequest
    )
    chat.stop = stop  # past the request's own checks: the sampling params check it again
    with pytest.raises(ApiError) as err:
        sampling_from(chat, max_tokens=None, logprobs=None)
    assert err.value.status == 400 and err.value.param == field and field in err.value.message


def test_finish_reason_and_usage_from_the_final_fields() -> None:
    fields: dict[str, Scalar] = {
        "finish_reason": "length",
        "prompt_tokens": 5,
        "completion_tokens": 2,
    }
    text = FinalOutput(0, OutputKind.TEXT, text="hi", fields=dict(fields))
    assert finish_reason(text) == "length"
    assert usage(text) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    bare = FinalOutput(0, OutputKind.TEXT, text="hi")  # a reference engine's text
    assert (finish_reason(bare), usage(bare)["total_tokens"], bare.logprobs) == ("stop", 0, None)
    # n choices: the prompt counted once, the choices' tokens summed.
    assert usage_of([text, text, bare]) == {
        "prompt_tokens": 5,
        "completion_tokens": 4,
        "total_tokens": 9,
    }


def test_choice_prompts_seed_each_choice() -> None:
    seeded = choice_prompts(Prompt(prompt="p", seed=2**63 - 2), 3)
    assert [p.seed for p in seeded] == [2**63 - 2, 2**63 - 1, 0]
    assert [p.seed for p in choice_prompts(Prompt(prompt="p"), 2)] == [None, None]


NAN = float("nan")


def engine_final(
    prefix: str = "", first_none: bool = False
) -> tuple[dict[str, Scalar], dict[str, np.ndarray]]:
    """What a vLLM text stage sends for two tokens asked with 2 alternatives: per token the
    dict in vLLM's order, the token itself first (here the second token was no top choice)."""
    sampled = [NAN if first_none else -0.25, -2.0]
    top = [[sampled[0], NAN, NAN] if first_none else [-0.25, -1.5, NAN], [-2.0, -0.5, -1.0]]
    tokens = [["He"] if first_none else ["He", "We"], ["llo", " there", "é"]]
    fields: dict[str, Scalar] = {f"{prefix}logprob_tokens": json.dumps(tokens)}
    arrays = {
        f"{prefix}logprobs": np.asarray(sampled, np.float32),
        f"{prefix}top_logprobs": np.asarray(top, np.float32),
    }
    return fields, arrays


def test_token_logprobs_in_vllms_chat_shape() -> None:
    lp = TokenLogprobs.read(*engine_final())
    assert lp is not None
    chat = lp.chat(2)["content"]
    assert [c["token"] for c in chat] == ["He", "llo"]
    assert chat[0] == {
        "token": "He",
        "logprob": -0.25,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.25, "bytes": [72, 101]},
            {"token": "We", "logprob": -1.5, "bytes": [87, 101]},
        ],
    }
    assert [t["token"] for t in chat[1]["top_logprobs"]] == ["llo", " there"]  # the first 2
    assert lp.chat(0)["content"][1]["top_logprobs"] == []


def test_token_logprobs_in_vllms_completion_shape_with_echo() -> None:
    out = TokenLogprobs.read(*engine_final())
    prompt = TokenLogprobs.read(*engine_final("prompt_", first_none=True), prefix="prompt_")
    assert out is not None and prompt is not None
    body = out.completion(1)
    assert body["tokens"] == ["He", "llo"] and body["token_logprobs"] == [-0.25, -2.0]
    # logprobs k: the first k+1 entries of each dict (the token itself and k more).
    assert body["top_logprobs"] == [{"He": -0.25, "We": -1.5}, {"llo": -2.0, " there": -0.5}]
    assert body["text_offset"] == [0, 2] and out.next_offset(0) == 5
    assert out.completion(0)["top_logprobs"] == [{"He": -0.25}, {"llo": -2.0}]
    echoed = (prompt + out).completion(0, text_offset=3)
    assert echoed["token_logprobs"] == [None, -2.0, -0.25, -2.0]
    assert echoed["top_logprobs"][0] is None and echoed["text_offset"] == [3, 5, 8, 10]


def test_text_output_chunks_join_their_logprobs() -> None:
    fields, arrays = engine_final()
    payload = payload_from_arrays({"text": "Hello", **fields}, arrays)
    part = final_output(PIPELINE, 0, payload)
    assert part.fields is not None and "logprob_tokens" not in part.fields
    joined = join_outputs([part, part])
    assert joined.text == "HelloHello" and joined.logprobs is not None
    assert joined.logprobs.tokens == ["He", "llo", "He", "llo"]
    assert TokenLogprobs.read({}, {}) is None  # a reference engine: none


def test_logprobs_are_null_where_the_text_stage_gives_none() -> None:
    bare = FinalOutput(0, OutputKind.TEXT, text="hi")  # a reference engine's text
    body = chat_completion(PIPELINE, [[bare], [bare]], want_audio=False, top_logprobs=3)
    assert [c["logprobs"] for c in body["choices"]] == [None, None]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    answer = CompletionAnswer(PIPELINE, 0, usage=False, logprobs=2, echo=True, prompt_text="p ")
    (choice,) = answer.unary([[bare]])["choices"]
    assert (choice["text"], choice["logprobs"]) == ("p hi", None)
