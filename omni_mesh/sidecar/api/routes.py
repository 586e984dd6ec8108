"""The client API of non-headless instances (DESIGN §10).

``/v1/generate`` runs the whole pipeline on a prompt object and returns the final outputs; the
OpenAI-compatible routes adapt it. ``/health`` and ``/metrics`` are served by every instance.

With ``async_chunk`` the answer may stream (see ``sinks.py``): ``/v1/audio/speech`` sends
audio as it comes (chunked WAV/PCM, or OpenAI's ``stream_format: "sse"``),
``/v1/chat/completions`` with ``stream: true`` sends ``chat.completion.chunk`` events and
``/v1/generate?stream=true`` one event per output chunk. Unary answers are unchanged.

``/v1/chat/completions`` (answers: ``chat_answer.py``) takes ``messages`` with roles
``system``/``developer``/``user``/``assistant`` (others: a 400 naming ``messages``): stage 0 gets
the last user message's text as ``prompt`` (what every engine reads) and the whole conversation
as field ``messages`` (JSON text; a chat-templated vLLM stage templates all of it, and
``usage.prompt_tokens`` counts the templated prompt); ``logprobs`` with ``top_logprobs``
0..20 (null where the text stage gives none: reference engines); ``n`` 1..8 choices, n requests
seeded ``seed + i`` (``choices.py``); the sampling fields of ``openai_text.py``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from omni_mesh.configs.pipeline_spec import OutputKind
from omni_mesh.data_plane import media, wire
from omni_mesh.data_plane.messages import Prompt, SamplingParams
from omni_mesh.sidecar.api import completions as routes_completions
from omni_mesh.sidecar.api import images as routes_images
from omni_mesh.sidecar.api.affinity_keys import conversation_start, named
from omni_mesh.sidecar.api.chat_answer import ChatEvents, chat_completion
from omni_mesh.sidecar.api.choices import choice_prompts, collect_choices, respond_choices
from omni_mesh.sidecar.api.client_requests import collect, entry, request_frames
from omni_mesh.sidecar.api.openai_text import sampling_from
from omni_mesh.sidecar.api.openai_types import ChatMessage, ChatRequest, SpeechRequest
from omni_mesh.sidecar.api.outputs import FinalOutput, final_stage
from omni_mesh.sidecar.api.playback import Playbacks
from omni_mesh.sidecar.api.realtime import route as realtime_route
from omni_mesh.sidecar.api.sinks import (
    GenerateEvents,
    Sink,
    SpeechAudio,
    SpeechEvents,
    respond,
)
from omni_mesh.sidecar.api.usage import Usage, merged
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.errors import ApiError, bad_request, decode_body
from omni_mesh.sidecar.pod import Pod

MAX_API_BODY = 1 << 20


async def _body(request: web.Request, type_: type[Any]) -> Any:
    raw = await wire.read_body(request, max_bytes=MAX_API_BODY)
    return decode_body(raw, type_, what="request body")


def _check_model(pod: Pod, model: str | None) -> None:
    if model is not None and model != pod.pipeline.name:
        raise ApiError(
            404,
            f"model {model!r} not found (this server serves {pod.pipeline.name!r})",
            param="model",
            type_="model_not_found",
        )


async def generate_outputs(
    pod: Pod,
    request: web.Request,
    prompt: Prompt,
    sampling: SamplingParams | None = None,
    usage: Usage | None = None,
) -> list[FinalOutput]:
    """The orchestrated path, its outputs joined (the same answer with async_chunk on or off);
    what it used tallied into ``usage``."""
    si = entry(pod, request, prompt, sampling)
    return await collect(pod.pipeline, request_frames(pod, request, si, usage=usage))


# ---- routes ----------------------------------------------------------------------------------


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _stream_query(request: web.Request) -> bool:
    """``?stream=`` as a boolean (absent: false); anything else is a 400 naming it."""
    values = request.query.getall("stream", [])
    if not values:
        return False
    if len(values) > 1:
        raise bad_request("stream: give the query parameter once", "stream")
    value = values[0].lower()
    if value not in _TRUE | _FALSE:
        raise bad_request(f"stream: {values[0]!r} is not a boolean (true or false)", "stream")
    return value in _TRUE


async def generate(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    prompt = await _body(request, Prompt)
    if _stream_query(request):
        si = entry(pod, request, prompt)
        sink = GenerateEvents(pod.pipeline)
        return await respond(request, pod.pipeline, request_frames(pod, request, si), sink)
    usage = Usage()
    outputs = await generate_outputs(pod, request, prompt, usage=usage)
    body = {
        "pipeline": pod.pipeline.name,
        "outputs": {str(o.stage_id): msgspec.to_builtins(o.to_run_output()) for o in outputs},
        "usage": {"omni": usage.extension()},
    }
    return web.json_response(body)


async def models(request: web.Request) -> web.Response:
    pod = request.app[POD]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {"id": pod.pipeline.name, "object": "model", "created": 0, "owned_by": "omni-mesh"}
            ],
        }
    )


async def speech(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    req: SpeechRequest = await _body(request, SpeechRequest)
    _check_model(pod, req.model)
    audio_stage = final_stage(pod.pipeline, OutputKind.AUDIO)
    if audio_stage is None:
        raise bad_request(f"pipeline {pod.pipeline.name!r} produces no audio", "model")
    fields = _voice_field(pod, req.voice)
    prompt = Prompt(prompt=req.input, seed=req.seed, priority=req.priority, **fields)
    si = entry(pod, request, prompt)
    playbacks = Playbacks.of_request(request, si.tenant)  # a streamed answer's audio SLOs
    usage = Usage()
    sink: Sink
    if req.stream_format == "sse":
        sink = SpeechEvents(audio_stage, req.speed, playbacks=playbacks, usage=usage)
    else:
        streams = req.stream if req.stream is not None else req.response_format == "pcm"
        sink = SpeechAudio(
            audio_stage, req.response_format, req.speed, streams=streams, playbacks=playbacks
        )
    frames = request_frames(pod, request, si, playbacks.attributes(), usage)
    try:
        return await respond(request, pod.pipeline, frames, sink)
    finally:
        playbacks.record(pod.metrics.audio, pod.pipeline.name)


def _voice_field(pod: Pod, voice: str | None) -> dict[str, Any]:
    if voice is None or "voice" not in pod.pipeline.prompt_fields:
        return {}
    return {"voice": voice}


#: The chat roles served (vLLM's server takes these for text conversations).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _content_text(message: ChatMessage, sep: str) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return sep.join(p.text for p in message.content if p.type == "text" and p.text)


#: What the ``prompt`` field says for a user turn that is audio only (the engine reads the audio
#: from ``messages``).
AUDIO_ONLY_PROMPT = "(audio)"


def _content_parts(i: int, message: ChatMessage, audio_in: bool) -> list[dict[str, Any]] | None:
    """The message's parts when it holds audio (text and input_audio, in order), else None: its
    text alone is what the engines read."""
    if not isinstance(message.content, list):
        return None
    parts: list[dict[str, Any]] = []
    has_audio = False
    for j, part in enumerate(message.content):
        if part.type == "input_audio":
            where = f"messages[{i}].content[{j}]"
            if not audio_in:
                raise bad_request(f"{where}: this pipeline takes no audio input", "messages")
            if part.input_audio is None:
                raise bad_request(f"{where}: input_audio part lacks its input_audio", "messages")
            has_audio = True
            audio = {"data": part.input_audio.data, "format": part.input_audio.format}
            parts.append({"type": "input_audio", "input_audio": audio})
        elif part.type == "text":
            if part.text:
                parts.append({"type": "text", "text": part.text})
        elif audio_in:  # a pipeline that reads parts says which it cannot read
            raise bad_request(
                f"messages[{i}].content[{j}]: part type {part.type!r} is not served "
                "(text, input_audio)",
                "messages",
            )
    return parts if has_audio else None


def _conversation(req: ChatRequest, audio_in: bool) -> tuple[str, str, float]:
    """The last user message's text (the ``prompt`` every engine reads), the whole
    conversation as JSON text (the ``messages`` a chat-templated stage reads: each message's
    text parts joined by newlines, as vLLM's server joins them, or, for a message with audio
    parts, the parts themselves) and the seconds of its input audio (usage)."""
    messages: list[dict[str, Any]] = []
    audio_turns: set[int] = set()
    audio_s = 0.0
    for i, message in enumerate(req.messages):
        if message.role not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role: {message.role!r} is not served "
                f"(one of {', '.join(sorted(CHAT_ROLES))})",
                "messages",
            )
        parts = _content_parts(i, message, audio_in)
        if parts is not None:
            audio_turns.add(i)
            audio_s += sum(
                media.b64_wav_seconds(p["input_audio"]["data"])
                for p in parts
                if p["type"] == "input_audio"
            )
        content: Any = parts if parts is not None else _content_text(message, "\n")
        messages.append({"role": message.role, "content": content})
    for i in range(len(req.messages) - 1, -1, -1):
        message = req.messages[i]
        if message.role == "user":
            text = _content_text(message, " ") or (AUDIO_ONLY_PROMPT if i in audio_turns else "")
            if text:
                return text, json.dumps(messages, ensure_ascii=False), audio_s
    raise bad_request("messages: no user message with text or audio content", "messages")


async def chat(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    req: ChatRequest = await _body(request, ChatRequest)
    _check_model(pod, req.model)
    want_audio = "audio" in (req.modalities or ())
    fields: dict[str, Any] = {}
    if want_audio:
        fields.update(_voice_field(pod, req.audio.voice if req.audio else None))
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is not None and "max_tokens" in pod.pipeline.prompt_fields:
        fields["max_tokens"] = max_tokens
    last_user, messages, audio_in_s = _conversation(req, pod.pipeline.input_audio)
    prompt = Prompt(prompt=last_user, seed=req.seed, priority=req.priority, **fields)
    top_logprobs = _chat_logprobs(req)
    sampling = sampling_from(req, max_tokens=None, logprobs=top_logprobs)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    text_stage = final_stage(pod.pipeline, OutputKind.TEXT)
    streams = []
    playbacks: Playbacks | None = None  # a streamed answer's audio SLOs, per choice
    usages: list[Usage] = []  # what each choice used
    affinity = (
        named("cache", req.prompt_cache_key)
        or named("user", req.user)
        or conversation_start(json.loads(messages))
    )
    for index, choice in enumerate(choice_prompts(prompt, req.n)):
        si = entry(pod, request, choice, sampling, affinity=affinity)
        si.payload.fields = {**si.payload.fields, "messages": messages}
        if not want_audio and text_stage is not None:  # the audio stages need not run
            si.final_stages = (text_stage,)
        if req.stream and want_audio:
            playbacks = playbacks or Playbacks.of_request(request, si.tenant)
        late = playbacks.attributes(index) if playbacks is not None else None
        usages.append(Usage(audio_in_s=audio_in_s if index == 0 else 0.0))
        streams.append(request_frames(pod, request, si, late, usages[-1]))
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        sink = ChatEvents(
            pod.pipeline,
            want_audio=want_audio,
            include_usage=include_usage,
            top_logprobs=top_logprobs,
            playbacks=playbacks,
            usages=usages,
        )
        try:
            return await respond_choices(request, pod.pipeline, streams, sink)
        finally:
            if playbacks is not None:
                playbacks.record(pod.metrics.audio, pod.pipeline.name)
    choices = await collect_choices(pod.pipeline, streams)
    body = chat_completion(pod.pipeline, choices, want_audio=want_audio, top_logprobs=top_logprobs)
    body["usage"] = {**body["usage"], "omni": merged(usages).extension()}
    return web.json_response(body)


def _chat_logprobs(req: ChatRequest) -> int | None:
    """How many alternatives per token (None: no logprobs), as vLLM's server reads
    ``logprobs``/``top_logprobs``."""
    if not req.logprobs:
        if req.top_logprobs:
            raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
        return None
    return req.top_logprobs or 0


async def health(request: web.Request) -> web.Response:
    pod = request.app[POD]
    if pod.draining:
        return web.json_response({"status": "draining"}, status=503)
    if pod.engine is not None and pod.engine.dead.is_set():
        return web.json_response({"status": "engine dead"}, status=503)
    if not pod.ready:
        return web.json_response({"status": "registering"}, status=503)
    return web.json_response(
        {"status": "ok", "stage_id": pod.stage_id, "instance_id": pod.instance_id}
    )


async def metrics(request: web.Request) -> web.Response:
    pod = request.app[POD]
    if pod.engine is not None:
        labels = (pod.pipeline.name, str(pod.stage_id))
        pod.metrics.engine_queued.labels(*labels).set(pod.engine.stats.queued)
        pod.metrics.engine_step.labels(*labels).set(pod.engine.stats.step_ms / 1000.0)
        stats = pod.engine.stats
        pod.metrics.usage.export_busy(labels, stats.busy_ms / 1000.0)
        if stats.step_audio_s > 0 and stats.step_ms > 0:  # a talker: its streams vs playback
            factor = stats.step_audio_s / (stats.step_ms / 1000.0)
            pod.metrics.audio.stream_realtime.labels(*labels).set(factor)
        model = pod.engine.stats.engine  # a model engine with its own scheduler (vLLM)
        if model is not None:
            pod.metrics.engine_running.labels(*labels).set(model.running)
            pod.metrics.engine_waiting.labels(*labels).set(model.waiting)
            pod.metrics.engine_kv_cache.labels(*labels).set(model.kv_cache_usage)
            pod.metrics.engine_tokens.labels(*labels).set(model.tokens_per_s)
            if pod.stage_config.prefill is not None:
                pod.metrics.kv.export_engine(labels, model)
    body = generate_latest(pod.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application, *, client_api: bool) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if client_api:
        app.router.add_post("/v1/generate", generate)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/audio/speech", speech)
        app.router.add_post("/v1/chat/completions", chat)
        routes_completions.add_routes(app)  # /v1/completions
        routes_images.add_routes(app)  # /v1/images/generations
        realtime_route.add_routes(app)  # /v1/realtime (WebSocket)
