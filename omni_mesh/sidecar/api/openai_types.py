"""Request bodies of the OpenAI-compatible routes (only the fields we use are typed; the
SDK's other fields are accepted and ignored, as OpenAI-compatible servers do)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from omni_mesh.data_plane.messages import PriorityClass


class InputAudio(Struct):
    data: Annotated[str, Meta(min_length=1)]  # base64
    format: str = "wav"


class ContentPart(Struct):
    """A part of a chat message: ``text``, or ``input_audio`` (pipelines that take audio in)."""

    type: str
    text: str | None = None
    input_audio: InputAudio | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None


class AudioParams(Struct):
    voice: str = "default"
    format: Literal["wav", "pcm16"] = "wav"


TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=1_000_000)]  # 0 = off
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
_StopText = Annotated[str, Meta(min_length=1, max_length=256)]
Stop = _StopText | Annotated[list[_StopText], Meta(max_length=16)]


#: OpenAI's ``prompt_cache_key`` and ``user``: free text a client names a session or user by.
CacheKey = Annotated[str, Meta(min_length=1, max_length=1024)]


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
    top_p: TopP | None = None
    top_k: TopK | None = None  # vLLM's extension (extra_body)
    repetition_penalty: RepetitionPenalty | None = None  # vLLM's extension (extra_body)
    ignore_eos: bool | None = None  # vLLM's extension (extra_body)
    stop: Stop | None = None
    logprobs: bool = False  # the sampled tokens' logprobs
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # alternatives per token
    n: Annotated[int, Meta(ge=1, le=8)] = 1  # choices: n requests (seed + i)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: PriorityClass | None = None  # admission class; X-Omni-Priority wins over it
    prompt_cache_key: CacheKey | None = None  # session affinity (affinity_keys.py)
    user: CacheKey | None = None  # session affinity when no prompt_cache_key


class CompletionRequest(Struct):
    """``/v1/completions``: a text prompt or the prompt's token ids."""

    model: str
    prompt: (
        Annotated[str, Meta(min_length=1, max_length=32_768)]
        | Annotated[
            list[Annotated[int, Meta(ge=0, le=2**31 - 1)]], Meta(min_length=1, max_length=8192)
        ]
    )
    max_tokens: Annotated[int, Meta(ge=1, le=8192)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # vLLM's extension (extra_body)
    repetition_penalty: RepetitionPenalty | None = None  # vLLM's extension (extra_body)
    ignore_eos: bool | None = None  # vLLM's extension (extra_body)
    stop: Stop | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None  # alternatives per token
    n: Annotated[int, Meta(ge=1, le=8)] = 1  # choices: n requests (seed + i)
    echo: bool = False  # the prompt before each choice's text (and its logprobs)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: PriorityClass | None = None  # admission class; X-Omni-Priority wins over it
    prompt_cache_key: CacheKey | None = None  # session affinity (affinity_keys.py)
    user: CacheKey | None = None  # session affinity when no prompt_cache_key


class SpeechRequest(Struct):
    model: str
    input: Annotated[str, Meta(min_length=1, max_length=32_768)]
    voice: str = "default"
    response_format: Literal["wav", "pcm"] = "wav"
    stream_format: Literal["audio", "sse"] = "audio"  # "sse": base64 PCM16 delta events
    # vLLM-Omni's: a WAV streams only when asked (true), else it comes whole with its true
    # lengths; unset, PCM streams (it has no header to get wrong); "sse" always streams.
    stream: bool | None = None
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    priority: PriorityClass | None = None  # admission class; X-Omni-Priority wins over it


class ImageRequest(Struct):
    """``/v1/images/generations`` (``images.py``); ``seed``, ``steps`` and ``guidance_scale`` are
    extensions (the SDK's ``extra_body``)."""

    prompt: Annotated[str, Meta(min_length=1, max_length=32_768)]
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=10)] = 1  # n requests seeded seed + i (``choices.py``)
    size: str | None = None  # "WIDTHxHEIGHT"; None or "auto": the pipeline's default
    response_format: str | None = None  # b64_json only (no image store to serve urls from)
    output_format: str | None = None  # png only
    stream: bool = False  # image_generation.* events
    partial_images: Annotated[int, Meta(ge=0, le=3)] | None = None  # previews when streaming
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    steps: Annotated[int, Meta(ge=1, le=200)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0.0, le=30.0)] | None = None
    priority: PriorityClass | None = None  # admission class; X-Omni-Priority wins over it
