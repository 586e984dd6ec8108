"""The client events of the OpenAI Realtime GA protocol, decoded and checked.

:func:`decode_event` turns one WebSocket text message into one of the event structs below, or
raises :class:`EventError` naming what is wrong: the ``param`` as a dotted path into the event
(``session.audio.input.format.type``) and the client's ``event_id`` when it could be read. The
session answers it with an ``error`` event and goes on. Fields of the GA shape that this fabric
does not serve (tools, transcription of input audio, semantic VAD...) are refused by name rather
than accepted and ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

#: The largest client event (an append of ~20 s of 24 kHz PCM16 in base64 is ~1.3 MB).
MAX_EVENT_BYTES = 4 * 1024 * 1024


class EventError(Exception):
    """A client event that cannot be served: an ``error`` event, the session goes on."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        event_id: str | None = None,
        code: str = "invalid_value",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.event_id = event_id
        self.code = code


class _Strict(Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


AudioFormatType = Literal["audio/pcm", "audio/pcmu", "audio/pcma"]


class AudioFormatIn(_Strict):
    type: AudioFormatType = "audio/pcm"
    rate: Literal[24000] | None = None  # audio/pcm: always 24000 in GA


class TurnDetectionIn(_Strict):
    type: Literal["server_vad", "semantic_vad"]
    threshold: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    prefix_padding_ms: Annotated[int, Meta(ge=0, le=10_000)] | None = None
    silence_duration_ms: Annotated[int, Meta(ge=0, le=10_000)] | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: Annotated[int, Meta(ge=1000, le=600_000)] | None = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None  # semantic_vad only


class AudioInputIn(_Strict):
    format: AudioFormatIn | UnsetType = UNSET
    turn_detection: TurnDetectionIn | UnsetType | None = UNSET
    transcription: dict[str, Any] | UnsetType | None = UNSET
    noise_reduction: dict[str, Any] | UnsetType | None = UNSET


class AudioOutputIn(_Strict):
    format: AudioFormatIn | UnsetType = UNSET
    voice: Annotated[str, Meta(min_length=1, max_length=64)] | UnsetType = UNSET
    speed: Annotated[float, Meta(ge=0.25, le=1.5)] | UnsetType = UNSET


class AudioIn(_Strict):
    input: AudioInputIn | UnsetType = UNSET
    output: AudioOutputIn | UnsetType = UNSET


Modality = Literal["text", "audio"]
MaxTokens = Annotated[int, Meta(ge=1, le=4096)] | Literal["inf"]


class SessionIn(_Strict):
    """``session.update``'s ``session`` (GA: ``type: "realtime"``)."""

    type: Literal["realtime", "transcription"] | UnsetType = UNSET
    model: str | UnsetType = UNSET
    instructions: Annotated[str, Meta(max_length=32_768)] | UnsetType = UNSET
    output_modalities: list[Modality] | UnsetType = UNSET
    audio: AudioIn | UnsetType = UNSET
    max_output_tokens: MaxTokens | UnsetType = UNSET
    tools: list[dict[str, Any]] | UnsetType = UNSET
    tool_choice: str | dict[str, Any] | UnsetType = UNSET
    tracing: str | dict[str, Any] | UnsetType | None = UNSET
    truncation: str | dict[str, Any] | UnsetType = UNSET
    include: list[str] | UnsetType | None = UNSET
    prompt: dict[str, Any] | UnsetType | None = UNSET


class ContentIn(_Strict):
    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text", "audio"]
    text: str | None = None
    audio: str | None = None  # base64, in the session's input format
    transcript: str | None = None


#: Ids a client may give items (what the session store keeps).
ItemId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_\-.:]{1,64}$")]
SESSION_ID = re.compile(r"^[A-Za-z0-9_\-.:]{1,128}$")


class ItemIn(_Strict):
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system"] | None = None
    content: list[ContentIn] = []
    id: ItemId | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class ResponseIn(_Strict):
    """``response.create``'s ``response``: overrides for this response only."""

    output_modalities: list[Modality] | UnsetType = UNSET
    instructions: Annotated[str, Meta(max_length=32_768)] | UnsetType = UNSET
    max_output_tokens: MaxTokens | UnsetType = UNSET
    conversation: Literal["auto", "none"] | UnsetType = UNSET
    input: list[ItemIn] | UnsetType = UNSET
    audio: dict[str, Any] | UnsetType = UNSET
    metadata: dict[str, str] | UnsetType | None = UNSET
    tools: list[dict[str, Any]] | UnsetType = UNSET
    tool_choice: str | dict[str, Any] | UnsetType = UNSET


class _Event(_Strict, tag_field="type", kw_only=True):
    event_id: Annotated[str, Meta(max_length=128)] | None = None


class SessionUpdate(_Event, tag="session.update"):
    session: SessionIn


class BufferAppend(_Event, tag="input_audio_buffer.append"):
    audio: str


class BufferCommit(_Event, tag="input_audio_buffer.commit"):
    pass


class BufferClear(_Event, tag="input_audio_buffer.clear"):
    pass


class ItemCreate(_Event, tag="conversation.item.create"):
    item: ItemIn
    previous_item_id: str | None = None


class ItemDelete(_Event, tag="conversation.item.delete"):
    item_id: str


class ItemRetrieve(_Event, tag="conversation.item.retrieve"):
    item_id: str


class ItemTruncate(_Event, tag="conversation.item.truncate"):
    item_id: str
    content_index: Annotated[int, Meta(ge=0)]
    audio_end_ms: Annotated[int, Meta(ge=0)]


class ResponseCreate(_Event, tag="response.create"):
    response: ResponseIn | None = None


class ResponseCancel(_Event, tag="response.cancel"):
    response_id: str | None = None


ClientEvent = (
    SessionUpdate
    | BufferAppend
    | BufferCommit
    | BufferClear
    | ItemCreate
    | ItemDelete
    | ItemRetrieve
    | ItemTruncate
    | ResponseCreate
    | ResponseCancel
)

EVENT_TYPES: frozenset[str] = frozenset(
    t.__struct_config__.tag  # type: ignore[misc]
    for t in (
        SessionUpdate,
        BufferAppend,
        BufferCommit,
        BufferClear,
        ItemCreate,
        ItemDelete,
        ItemRetrieve,
        ItemTruncate,
        ResponseCreate,
        ResponseCancel,
    )
)

_DECODER = msgspec.json.Decoder(ClientEvent)
_RAW = msgspec.json.Decoder(dict[str, Any])
_AT = re.compile(r"\s*- at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`")
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]+)`")


def _param(path: str) -> str | None:
    """``$.session.audio[0].x`` (msgspec's path) → ``session.audio[0].x``."""
    path = path.lstrip(".")
    return path or None


def decode_event(data: str | bytes) -> ClientEvent:
    """One client event from a WebSocket message (see the module docstring)."""
    if len(data) > MAX_EVENT_BYTES:
        raise EventError(
            f"event of {len(data)} bytes is larger than the {MAX_EVENT_BYTES} allowed",
            code="event_too_large",
        )
    try:
        raw = _RAW.decode(data)
    except msgspec.DecodeError as exc:
        raise EventError(f"the message is not a JSON object ({exc})", code="invalid_json") from None
    event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise EventError("the event has no string 'type'", param="type", event_id=event_id)
    if kind not in EVENT_TYPES:
        raise EventError(
            f"unknown event type {kind[:80]!r}",
            param="type",
            event_id=event_id,
            code="unknown_event_type",
        )
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        message = str(exc)
        found = _AT.search(message)
        path = found.group("path") if found else ""
        unknown = _UNKNOWN.match(message)
        if unknown is not None:
            path = f"{path}.{unknown.group('name')}"
            text = f"unknown parameter {_param(path)!r}"
            raise EventError(
                text, param=_param(path), event_id=event_id, code="unknown_parameter"
            ) from None
        text = _AT.sub("", message)
        missing = _MISSING.match(message)
        if missing is not None:
            path = f"{path}.{missing.group('name')}"
            text = "missing required parameter"
        param = _param(path)
        raise EventError(
            f"{param}: {text}" if param else text, param=param, event_id=event_id
        ) from None
