"""A session's conversation: item order (``previous_item_id``), truncation to what the user
heard, and the chat messages a response hands the thinker (user audio as ``input_audio``)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from omni_mesh.sidecar.api.realtime.client_events import EventError, ItemIn, decode_event
from omni_mesh.sidecar.api.realtime.conversation import (
    Conversation,
    Item,
    Part,
    audio_part,
    item_from_client,
    model_messages,
)


def user_text(item_id: str, text: str) -> Item:
    return Item(id=item_id, role="user", parts=[Part(type="input_text", text=text)])


def spoken(item_id: str, transcript: str, ms: int) -> Item:
    part = Part(type="output_audio", transcript=transcript, audio_ms=ms)
    return Item(id=item_id, role="assistant", parts=[part])


def test_items_go_where_previous_item_id_says() -> None:
    conv = Conversation()
    conv.add(user_text("a", "one"))
    conv.add(user_text("c", "three"))
    conv.add(user_text("b", "two"), "a")
    conv.add(user_text("z", "zero"), "root")
    assert conv.ids() == ["z", "a", "b", "c"]
    assert conv.previous_id("b") == "a" and conv.previous_id("z") is None
    with pytest.raises(EventError) as info:
        conv.add(user_text("d", "x"), "nope")
    assert info.value.param == "previous_item_id"
    with pytest.raises(EventError, match="exists already"):
        conv.add(user_text("a", "again"))
    conv.delete("b")
    assert conv.ids() == ["z", "a", "c"]


def test_truncate_keeps_what_was_heard() -> None:
    conv = Conversation([spoken("s", "one two three four five six seven eight", 4000)])
    item = conv.truncate("s", 0, 1000)
    assert item.parts[0].transcript == "one two" and item.parts[0].audio_ms == 1000
    assert item.status == "incomplete"
    with pytest.raises(EventError) as info:
        conv.truncate("s", 0, 1001)  # past the (new) end
    assert info.value.param == "audio_end_ms"
    with pytest.raises(EventError) as info:
        conv.truncate("s", 1, 10)
    assert info.value.param == "content_index"
    conv.add(user_text("u", "hi"))
    with pytest.raises(EventError, match="only assistant items"):
        conv.truncate("u", 0, 0)


def test_messages_carry_user_audio_as_input_audio_parts() -> None:
    samples = (np.sin(np.arange(2400) / 5) * 8000).astype(np.int16)
    items = [
        Item(id="u1", role="user", parts=[audio_part(samples, 24000)]),
        spoken("a1", "sure thing", 900),
        user_text("u2", "and then?"),
    ]
    prompt, messages = model_messages(items, "be brief", audio_in=True)
    assert prompt == "and then?"
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    (part,) = messages[1]["content"]
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    wav = base64.b64decode(part["input_audio"]["data"])
    assert wav[:4] == b"RIFF" and len(wav) == 44 + 2 * len(samples)
    assert messages[2]["content"] == "sure thing"
    audio_only, _ = model_messages(items[:1], "", audio_in=True)
    assert audio_only == "(audio)"
    with pytest.raises(EventError) as info:
        model_messages([spoken("a", "x", 10)], "", audio_in=True)
    assert info.value.code == "conversation_empty"


def test_client_items_are_checked() -> None:
    def item(raw: dict[str, object]) -> ItemIn:
        event = decode_event(json.dumps({"type": "conversation.item.create", "item": raw}))
        return event.item  # type: ignore[union-attr]

    pcm = base64.b64encode(np.zeros(2400, np.int16).tobytes()).decode()
    got = item_from_client(
        item({"type": "message", "role": "user",
              "content": [{"type": "input_audio", "audio": pcm}]}), "audio/pcm", True
    )  # fmt: skip
    assert got.parts[0].audio_ms == 100
    for raw, param in [
        ({"type": "function_call"}, "item.type"),
        ({"role": "user", "content": []}, "item.content"),
        ({"role": "user", "content": [{"type": "input_audio", "audio": "%%%"}]},
         "item.content[0].audio"),
        ({"role": "user", "content": [{"type": "input_audio", "audio": "AAAA"}]},
         "item.content[0].audio"),  # 3 bytes: not whole PCM16 samples
        ({"role": "assistant", "content": [{"type": "input_text", "text": "x"}]},
         "item.content[0].type"),
    ]:  # fmt: skip
        with pytest.raises(EventError) as info:
            item_from_client(item(raw), "audio/pcm", True)
        assert info.value.param == param, (raw, info.value.message)
    with pytest.raises(EventError, match="takes no audio input"):
        item_from_client(
            item({"role": "user", "content": [{"type": "input_audio", "audio": pcm}]}),
            "audio/pcm",
            False,
        )
