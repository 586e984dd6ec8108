"""``POST /v1/completions``: OpenAI's (legacy) text completions, as vLLM's own server answers
them for the fields they share — a prompt string or the prompt's token ids, ``max_tokens``,
``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs`` (0: the sampled tokens' own),
``stream`` (``text_completion`` events, then ``[DONE]``; ``stream_options.include_usage`` adds a
last event with ``usage``). The pipeline must give a text output (``tiny-llm``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from omni_mesh.configs.pipeline import OutputKind, PipelineSpec
from omni_mesh.data_plane import wire
from omni_mesh.data_plane.messages import Prompt
from omni_mesh.data_plane.tensors import tensor_from_array
from omni_mesh.sidecar.admission import openai_priority
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.client_requests import entry, request_frames
from omni_mesh.sidecar.errors import ApiError, bad_request, decode_body, error_body
from omni_mesh.sidecar.openai_text import finish_reason, sampling_from, token_logprobs, usage
from omni_mesh.sidecar.openai_types import CompletionRequest
from omni_mesh.sidecar.outputs import FinalOutput, OutputChunk, final_stage
from omni_mesh.sidecar.sinks import SSE_CONTENT_TYPE, respond, sse

MAX_COMPLETION_BODY = 1 << 20
_TOKEN_PROMPT = " "  # the prompt field of a token-id prompt (the engine reads its token_ids)


def _logprobs_body(values: list[float] | None) -> dict[str, Any] | None:
    if values is None:
        return None
    return {"token_logprobs": values, "tokens": None, "top_logprobs": None, "text_offset": None}


class CompletionAnswer:
    """The answer of ``/v1/completions``: one ``text_completion`` object, or (``stream``) its
    events — a ``text`` delta per output chunk, a last choice with ``finish_reason``, usage
    when asked, ``[DONE]``."""

    encodes = False

    def __init__(self, pipeline: PipelineSpec, text_stage: int, *, stream: bool, usage: bool):
        self.model = pipeline.name
        self.text_stage = text_stage
        self.always_stream = stream
        self.content_type = SSE_CONTENT_TYPE
        self.include_usage = usage
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    @staticmethod
    def _choice(text: str, reason: str | None, logprobs: list[float] | None) -> dict[str, Any]:
        return {
            "index": 0,
            "text": text,
            "logprobs": _logprobs_body(logprobs),
            "finish_reason": reason,
        }

    def _text(self, outputs: list[FinalOutput]) -> FinalOutput | None:
        return next((o for o in outputs if o.stage_id == self.text_stage), None)

    def piece(self, chunk: OutputChunk) -> bytes:
        # Every chunk is an event, its text empty when its tokens are no whole character yet
        # (as vLLM's server sends them).
        if not self.always_stream or chunk.stage_id != self.text_stage:
            return b""
        choice = self._choice(chunk.output.text or "", None, token_logprobs(chunk.output))
        return sse(self._object([choice]))

    def unary(self, outputs: list[FinalOutput]) -> web.StreamResponse:
        text = self._text(outputs)
        choice = self._choice(
            text.text or "" if text else "", finish_reason(text), token_logprobs(text)
        )
        return web.json_response(self._object([choice], usage=usage(text)))

    def tail(self, outputs: list[FinalOutput]) -> bytes:
        text = self._text(outputs)
        out = sse(self._object([self._choice("", finish_reason(text), None)]))
        if self.include_usage:
            out += sse(self._object([], usage=usage(text)))
        return out + b"data: [DONE]\n\n"

    def error_event(self, err: ApiError) -> bytes:
        return sse({"error": error_body(err)})


async def completions(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    raw = await wire.read_body(request, max_bytes=MAX_COMPLETION_BODY)
    req: CompletionRequest = decode_body(raw, CompletionRequest, what="request body")
    if req.model != pod.pipeline.name:
        raise ApiError(
            404,
            f"model {req.model!r} not found (this server serves {pod.pipeline.name!r})",
            param="model",
            type_="model_not_found",
        )
    text_stage = final_stage(pod.pipeline, OutputKind.TEXT)
    if text_stage is None:
        raise bad_request(f"pipeline {pod.pipeline.name!r} produces no text", "model")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    sampling = sampling_from(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    token_ids = None if isinstance(req.prompt, str) else req.prompt
    text = _TOKEN_PROMPT if token_ids else str(req.prompt)
    prompt = Prompt(prompt=text, seed=req.seed, priority=openai_priority(request, req.priority))
    si = entry(pod, request, prompt, sampling, param="prompt")
    if token_ids is not None:
        ids = np.asarray(token_ids, dtype=np.int64)
        si.payload.tensors = {**si.payload.tensors, "token_ids": tensor_from_array(ids)}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    answer = CompletionAnswer(pod.pipeline, text_stage, stream=req.stream, usage=include_usage)
    return await respond(request, pod.pipeline, request_frames(pod, request, si), answer)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
