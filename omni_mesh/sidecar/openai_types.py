"""Request bodies of the OpenAI-compatible routes (only the fields we use are typed; the
SDK's other fields are accepted and ignored, as OpenAI-compatible servers do)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct


class TextPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[TextPart] | None = None


class AudioParams(Struct):
    voice: str = "default"
    format: Literal["wav", "pcm16"] = "wav"


class StreamOptions(Struct):
    include_usage: bool = False


class ChatRequest(Struct):
    model: str
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=256)]
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioParams | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=8192)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=8192)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class SpeechRequest(Struct):
    model: str
    input: Annotated[str, Meta(min_length=1, max_length=32_768)]
    voice: str = "default"
    response_format: Literal["wav", "pcm"] = "wav"
    stream_format: Literal["audio", "sse"] = "audio"  # "sse": base64 PCM16 delta events
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None


class ImageRequest(Struct):
    prompt: Annotated[str, Meta(min_length=1, max_length=32_768)]
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=8)] = 1
    size: str = "64x64"
    response_format: Literal["b64_json"] = "b64_json"
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
