"""The OpenAI text routes' shared pieces: sampling params only where the request sets them (the
stage's defaults apply to the rest), a bad value a 400 naming the field, and ``finish_reason`` /
``usage`` / logprobs read from the text stage's final fields (absent: ``stop``, zeros)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from omni_mesh.configs.pipeline import OutputKind
from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.sidecar.errors import ApiError
from omni_mesh.sidecar.openai_text import finish_reason, sampling_from, token_logprobs, usage
from omni_mesh.sidecar.openai_types import ChatRequest, CompletionRequest
from omni_mesh.sidecar.outputs import FinalOutput

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


def test_finish_reason_usage_and_logprobs_from_the_final_fields() -> None:
    text = FinalOutput(
        0,
        OutputKind.TEXT,
        text="hi",
        fields={"finish_reason": "length", "prompt_tokens": 5, "completion_tokens": 2},
        array=np.array([-0.5, -1.0], dtype=np.float32),
    )
    assert finish_reason(text) == "length"
    assert usage(text) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert token_logprobs(text) == [-0.5, -1.0]
    bare = FinalOutput(0, OutputKind.TEXT, text="hi")  # a reference engine's text
    assert (finish_reason(bare), usage(bare)["total_tokens"], token_logprobs(bare)) == (
        "stop",
        0,
        None,
    )
