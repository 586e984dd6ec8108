"""The chat route's conversation: ``input_audio`` parts travel in ``messages`` (in order, with
the text parts) for a pipeline that reads audio, and are a 400 naming the part elsewhere; an
audio-only user turn still gives the engines a ``prompt``; a pipeline that reads parts rejects
the part types it cannot read."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import numpy as np
import pytest

from omni_mesh.data_plane import media
from omni_mesh.sidecar.api.openai_types import ChatRequest
from omni_mesh.sidecar.api.routes import AUDIO_ONLY_PROMPT, _conversation
from omni_mesh.sidecar.errors import ApiError

pytestmark = pytest.mark.unit

AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


def request(*messages: dict[str, Any]) -> ChatRequest:
    return msgspec.convert({"model": "m", "messages": list(messages)}, ChatRequest)


def test_audio_parts_travel_in_order_with_the_text() -> None:
    req = request(
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hear"}, AUDIO]},
    )
    prompt, messages, audio_s = _conversation(req, audio_in=True)
    assert prompt == "hear" and audio_s == 0.0  # a header without its fmt chunk: unknown
    assert json.loads(messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hear"}, AUDIO]},
    ]


def test_an_audio_only_turn_still_has_a_prompt() -> None:
    prompt, messages, _ = _conversation(request({"role": "user", "content": [AUDIO]}), True)
    assert prompt == AUDIO_ONLY_PROMPT and json.loads(messages)[0]["content"] == [AUDIO]


def test_the_input_audio_seconds_are_counted_for_usage() -> None:
    wav = base64.b64encode(media.wav_bytes(np.zeros(12000, np.float32), 24000)).decode()
    part = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
    turn = {"role": "user", "content": [part, {"type": "text", "text": "and"}, part]}
    _, _, audio_s = _conversation(request(turn), True)
    assert audio_s == pytest.approx(1.0)  # two half-second clips


@pytest.mark.parametrize(
    ("content", "audio_in", "message"),
    [
        ([AUDIO], False, "messages[0].content[0]: this pipeline takes no audio input"),
        ([{"type": "input_audio"}], True, "input_audio part lacks its input_audio"),
        (
            [{"type": "image_url", "image_url": {"url": "x"}}, AUDIO],
            True,
            "messages[0].content[0]: part type 'image_url' is not served",
        ),
    ],
)
def test_unusable_parts_are_400s_naming_the_part(
    content: list[dict[str, Any]], audio_in: bool, message: str
) -> None:
    with pytest.raises(ApiError) as err:
        _conversation(request({"role": "user", "content": content}), audio_in)
    assert err.value.status == 400 and message in str(err.value)


def test_text_pipelines_keep_joining_text_parts() -> None:
    req = request(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    prompt, messages, _ = _conversation(req, audio_in=False)
    assert prompt == "a b" and json.loads(messages)[0]["content"] == "a\nb"
