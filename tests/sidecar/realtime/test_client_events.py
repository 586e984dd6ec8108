"""Client events of the Realtime GA protocol: decoded into their structs, or an ``EventError``
naming the ``param`` at fault and the client's ``event_id``; session updates checked against
the pipeline (a field this fabric does not serve is refused by name, never ignored)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.sidecar.api.realtime import client_events as ce
from omni_mesh.sidecar.api.realtime.config import (
    apply_update,
    default_config,
    response_overrides,
    session_object,
)

QWEN = get_pipeline("qwen3-omni")
TTS = get_pipeline("tiny-tts")


def err(data: str | bytes) -> ce.EventError:
    with pytest.raises(ce.EventError) as info:
        ce.decode_event(data)
    return info.value


def test_every_event_type_decodes() -> None:
    events: list[dict[str, Any]] = [
        {"type": "session.update", "session": {"type": "realtime", "instructions": "be brief"}},
        {"type": "input_audio_buffer.append", "audio": "AAA="},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.clear"},
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": "hi"}]},
            "previous_item_id": "root",
        },
        {"type": "conversation.item.delete", "item_id": "a"},
        {"type": "conversation.item.retrieve", "item_id": "a"},
        {"type": "conversation.item.truncate", "item_id": "a", "content_index": 0,
         "audio_end_ms": 10},
        {"type": "response.create", "response": {"output_modalities": ["text"]}},
        {"type": "response.cancel"},
    ]  # fmt: skip
    for raw in events:
        event = ce.decode_event(json.dumps({**raw, "event_id": "e1"}))
        assert type(event).__struct_config__.tag == raw["type"]
        assert event.event_id == "e1"


@pytest.mark.parametrize(
    ("data", "code", "param"),
    [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "invalid_json", None),
        ('{"event_id": "x"}', "invalid_value", "type"),
        ('{"type": "session.create", "event_id": "x"}', "unknown_event_type", "type"),
        ('{"type": "conversation.item.delete", "event_id": "x"}', "invalid_value", "item_id"),
        (
            '{"type": "session.update", "event_id": "x", "session": {"modalities": ["text"]}}',
            "unknown_parameter",
            "session.modalities",
        ),
        (
            '{"type": "session.update", "event_id": "x", '
            '"session": {"audio": {"input": {"format": {"type": "audio/opus"}}}}}',
            "invalid_value",
            "session.audio.input.format.type",
        ),
        (
            '{"type": "conversation.item.truncate", "event_id": "x", "item_id": "a", '
            '"content_index": 0, "audio_end_ms": -5}',
            "invalid_value",
            "audio_end_ms",
        ),
    ],
)
def test_bad_events_name_what_is_wrong(data: str, code: str, param: str | None) -> None:
    e = err(data)
    assert (e.code, e.param) == (code, param), e.message
    if "event_id" in data:
        assert e.event_id == "x"


def test_an_oversized_event_is_refused_before_parsing() -> None:
    e = err(b"{" + b" " * ce.MAX_EVENT_BYTES + b"}")
    assert e.code == "event_too_large"


def update(**session: Any) -> ce.SessionIn:
    event = ce.decode_event(json.dumps({"type": "session.update", "session": session}))
    assert isinstance(event, ce.SessionUpdate)
    return event.session


def test_session_update_applies_the_ga_shape() -> None:
    config = default_config(QWEN)
    assert config.output_modalities == ["audio"] and config.turn_detection is not None
    new = apply_update(
        QWEN,
        config,
        update(
            type="realtime",
            instructions="be brief",
            audio={
                "input": {"format": {"type": "audio/pcmu"},
                          "turn_detection": {"type": "server_vad", "silence_duration_ms": 300}},
                "output": {"format": {"type": "audio/pcma"}, "voice": "ethan", "speed": 1.25},
            },
        ),
    )  # fmt: skip
    assert (new.instructions, new.input_format, new.output_format, new.voice) == (
        "be brief", "audio/pcmu", "audio/pcma", "ethan"
    )  # fmt: skip
    assert new.speed == 1.25  # the answer is time-stretched (sidecar/api/time_stretch.py)
    assert new.turn_detection is not None and new.turn_detection.silence_duration_ms == 300
    assert new.turn_detection.threshold == 0.5  # the rest kept
    wire = session_object("sess_1", new)
    assert wire["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert wire["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 300
    off = apply_update(QWEN, new, update(audio={"input": {"turn_detection": None}}))
    assert off.turn_detection is None


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"type": "transcription"}, "session.type"),
        ({"tools": [{"type": "function", "name": "f"}]}, "session.tools"),
        ({"model": "gpt-realtime"}, "session.model"),
        ({"output_modalities": ["text", "audio"]}, "session.output_modalities"),
        ({"audio": {"input": {"transcription": {"model": "whisper-1"}}}},
         "session.audio.input.transcription"),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
         "session.audio.input.turn_detection.type"),
    ],
)  # fmt: skip
def test_session_update_refuses_what_is_not_served(session: dict[str, Any], param: str) -> None:
    config = default_config(QWEN)
    with pytest.raises(ce.EventError) as info:
        apply_update(QWEN, config, update(**session))
    assert info.value.param == param


def test_a_pipeline_without_audio_input_has_no_turn_detection() -> None:
    config = default_config(TTS)
    assert config.turn_detection is None
    with pytest.raises(ce.EventError, match="takes no audio input"):
        apply_update(
            TTS, config, update(audio={"input": {"turn_detection": {"type": "server_vad"}}})
        )


def test_response_overrides_are_for_one_response() -> None:
    config = default_config(QWEN)
    event = ce.decode_event(
        json.dumps({"type": "response.create",
                    "response": {"output_modalities": ["text"], "max_output_tokens": 5}})
    )  # fmt: skip
    assert isinstance(event, ce.ResponseCreate)
    one = response_overrides(QWEN, config, event.response)
    assert (one.output_modalities, one.max_output_tokens) == (["text"], 5)
    assert config.output_modalities == ["audio"]
    with pytest.raises(ce.EventError) as info:
        response_overrides(QWEN, config, ce.ResponseIn(conversation="none"))
    assert info.value.param == "response.conversation"
