"""A realtime session's conversation: its items in order, what the client may do to them (create,
delete, truncate), and the chat messages a response hands to the pipeline.

An item is kept as the store keeps it (:class:`Item`): user audio as a base64 WAV at the rate it
came in (what the thinker's ``input_audio`` part takes, resampled there), assistant audio only as
its duration and transcript: the history is what the user heard. Truncating an assistant item at
``audio_end_ms`` cuts its transcript to the same share of its words, so the next response's
context holds only the part that was played (OpenAI drops the whole transcript instead; a text
thinker would then forget what it said).
"""

from __future__ import annotations

import base64
import binascii
import secrets
from typing import Any

from msgspec import Struct

from omni_mesh.sidecar.api.realtime import audio_formats
from omni_mesh.sidecar.api.realtime.client_events import ContentIn, EventError, ItemIn

#: Items a response's context holds (the most recent): a long session does not grow every
#: response's prompt without bound.
MAX_CONTEXT_ITEMS = 64
#: Items a conversation keeps; the oldest go first.
MAX_ITEMS = 512
#: What the thinker's prompt says for a user turn that is audio only (as the chat route).
AUDIO_ONLY_PROMPT = "(audio)"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class Part(Struct, omit_defaults=True):
    type: str  # input_text, input_audio, output_text, output_audio
    text: str | None = None
    transcript: str | None = None
    wav: str | None = None  # input_audio: base64 WAV (PCM16 mono)
    audio_ms: int = 0  # audio parts: the audio's duration

    def wire(self) -> dict[str, Any]:
        if self.type in ("input_text", "output_text"):
            return {"type": self.type, "text": self.text or ""}
        return {"type": self.type, "transcript": self.transcript}


class Item(Struct, omit_defaults=True):
    id: str
    role: str  # user, assistant, system
    parts: list[Part]
    status: str = "completed"

    def wire(self) -> dict[str, Any]:
        """The GA ``realtime.item`` (audio bytes left out: the client has them)."""
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": [p.wire() for p in self.parts],
        }

    def text(self) -> str:
        return " ".join(
            t for p in self.parts if (t := p.text if p.text is not None else p.transcript)
        )


def audio_part(samples: Any, rate: int) -> Part:
    """A user audio part from int16 samples at ``rate``."""
    wav = base64.b64encode(audio_formats.wav_bytes(samples, rate)).decode()
    return Part(type="input_audio", wav=wav, audio_ms=int(len(samples) * 1000 // rate))


def _content(item: ItemIn, i: int, part: ContentIn, input_format: str, audio_in: bool) -> Part:
    at = f"item.content[{i}]"
    role = item.role
    if part.type in ("input_text", "text") and role in ("user", "system"):
        if part.text is None:
            raise EventError(f"{at}.text: an input_text part needs its text", param=f"{at}.text")
        return Part(type="input_text", text=part.text)
    if part.type == "input_audio" and role == "user":
        if not audio_in:
            raise EventError(f"{at}: this pipeline takes no audio input", param=f"{at}.type")
        if part.audio is None:
            raise EventError(
                f"{at}.audio: an input_audio part needs its audio", param=f"{at}.audio"
            )
        try:
            raw = base64.b64decode(part.audio, validate=True)
            samples = audio_formats.decode(input_format, raw)
        except (binascii.Error, ValueError) as exc:
            raise EventError(f"{at}.audio: {exc}", param=f"{at}.audio") from None
        if len(samples) == 0:
            raise EventError(f"{at}.audio: no audio", param=f"{at}.audio")
        return audio_part(samples, audio_formats.format_rate(input_format))
    if part.type in ("output_text", "text") and role == "assistant":
        return Part(type="output_text", text=part.text or "")
    if part.type in ("output_audio", "audio") and role == "assistant":
        if part.audio is not None:
            raise EventError(
                f"{at}.audio: assistant audio cannot be created (give its transcript)",
                param=f"{at}.audio",
            )
        return Part(type="output_audio", transcript=part.transcript or "")
    raise EventError(
        f"{at}.type: {part.type!r} is not a content type of a {role} message", param=f"{at}.type"
    )


def item_from_client(item: ItemIn, input_format: str, audio_in: bool) -> Item:
    """A ``conversation.item.create`` item as the conversation keeps it."""
    if item.type != "message":
        raise EventError(
            f"item.type: {item.type!r} items are not served (tools are not)", param="item.type"
        )
    if item.role is None:
        raise EventError("item.role: a message needs its role", param="item.role")
    if not item.content:
        raise EventError("item.content: a message needs content", param="item.content")
    parts = [_content(item, i, p, input_format, audio_in) for i, p in enumerate(item.content)]
    return Item(id=item.id or new_id("item"), role=item.role, parts=parts)


class Conversation:
    """The items of one session, in order."""

    def __init__(self, items: list[Item] | None = None) -> None:
        self.items: list[Item] = list(items or [])

    def ids(self) -> list[str]:
        return [i.id for i in self.items]

    def find(self, item_id: str) -> Item | None:
        return next((i for i in self.items if i.id == item_id), None)

    def previous_id(self, item_id: str) -> str | None:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return self.items[i - 1].id if i else None
        return None

    def add(self, item: Item, previous_item_id: str | None = None) -> list[Item]:
        """Insert ``item`` (after ``previous_item_id``, ``"root"``: first; None: last); the
        items dropped from the front when the conversation is full."""
        if self.find(item.id) is not None:
            raise EventError(f"item.id: an item {item.id!r} exists already", param="item.id")
        if previous_item_id is None:
            self.items.append(item)
        elif previous_item_id == "root":
            self.items.insert(0, item)
        else:
            for i, existing in enumerate(self.items):
                if existing.id == previous_item_id:
                    self.items.insert(i + 1, item)
                    break
            else:
                raise EventError(
                    f"previous_item_id: no item {previous_item_id!r}", param="previous_item_id"
                )
        dropped = self.items[: max(0, len(self.items) - MAX_ITEMS)]
        del self.items[: len(dropped)]
        return dropped

    def delete(self, item_id: str) -> None:
        item = self.find(item_id)
        if item is None:
            raise EventError(f"item_id: no item {item_id!r}", param="item_id")
        self.items.remove(item)

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> Item:
        """Cut an assistant audio item at ``audio_end_ms`` (what the user heard of it)."""
        item = self.find(item_id)
        if item is None:
            raise EventError(f"item_id: no item {item_id!r}", param="item_id")
        if item.role != "assistant":
            raise EventError("item_id: only assistant items can be truncated", param="item_id")
        if content_index >= len(item.parts) or item.parts[content_index].type != "output_audio":
            raise EventError(
                f"content_index: part {content_index} of {item_id!r} is not its audio",
                param="content_index",
            )
        part = item.parts[content_index]
        if audio_end_ms > part.audio_ms:
            raise EventError(
                f"audio_end_ms: {audio_end_ms} is past the end of the item's audio "
                f"({part.audio_ms} ms)",
                param="audio_end_ms",
            )
        words = (part.transcript or "").split()
        keep = round(len(words) * audio_end_ms / part.audio_ms) if part.audio_ms else 0
        part.transcript = " ".join(words[:keep])
        if audio_end_ms < part.audio_ms:
            item.status = "incomplete"
        part.audio_ms = audio_end_ms
        return item


def _message(item: Item, audio_in: bool) -> dict[str, Any] | None:
    if item.role != "user" or not audio_in or all(p.type != "input_audio" for p in item.parts):
        text = item.text()
        return {"role": item.role, "content": text} if text else None
    content: list[dict[str, Any]] = []
    for p in item.parts:
        if p.type == "input_audio" and p.wav is not None:
            content.append({"type": "input_audio", "input_audio": {"data": p.wav, "format": "wav"}})
        elif p.text:
            content.append({"type": "text", "text": p.text})
    return {"role": "user", "content": content}


def model_messages(
    items: list[Item], instructions: str, *, audio_in: bool
) -> tuple[str, list[dict[str, Any]]]:
    """The ``prompt`` (the last user turn's text) and the chat ``messages`` of a response's
    context; an :class:`EventError` when it holds no user turn."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    context = items[-MAX_CONTEXT_ITEMS:]
    for item in context:
        message = _message(item, audio_in)
        if message is not None:
            messages.append(message)
    for item in reversed(context):
        if item.role == "user":
            has_audio = any(p.type == "input_audio" for p in item.parts)
            prompt = item.text() or (AUDIO_ONLY_PROMPT if has_audio else "")
            if prompt:
                return prompt, messages
    raise EventError(
        "the conversation has no user message to respond to (append audio and commit it, or "
        "create a user item)",
        code="conversation_empty",
    )
