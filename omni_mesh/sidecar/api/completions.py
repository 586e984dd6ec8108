"""``POST /v1/completions``: OpenAI's (legacy) text completions, as vLLM's own server answers
them for the fields they share — a prompt string or the prompt's token ids, ``max_tokens``,
``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs`` (0..5 alternatives per token:
``tokens``, ``token_logprobs``, ``top_logprobs`` maps, ``text_offset``), ``n`` (1..8 choices,
see ``choices.py``), ``echo`` (the prompt before each choice's text, with its logprobs when
asked, the first token's null), ``stream`` (``text_completion`` events, then ``[DONE]``;
``stream_options.include_usage`` adds a last event with ``usage``). The pipeline must give a
text output (``tiny-llm``); logprobs are null where its text stage gives none (reference
engines).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec
from omni_mesh.data_plane import wire
from omni_mesh.data_plane.messages import Prompt, Scalar
from omni_mesh.data_plane.tensors import tensor_from_array
from omni_mesh.sidecar.api.affinity_keys import named, prompt_prefix
from omni_mesh.sidecar.api.choices import choice_prompts, collect_choices, respond_choices
from omni_mesh.sidecar.api.client_requests import entry, request_frames
from omni_mesh.sidecar.api.openai_text import finish_reason, sampling_from, usage_of
from omni_mesh.sidecar.api.openai_types import CompletionRequest
from omni_mesh.sidecar.api.outputs import FinalOutput, OutputChunk, final_stage
from omni_mesh.sidecar.api.sinks import SSE_CONTENT_TYPE, sse
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.errors import ApiError, bad_request, decode_body, error_body

MAX_COMPLETION_BODY = 1 << 20
_TOKEN_PROMPT = " "  # the prompt field of a token-id prompt (the engine reads its token_ids)


class CompletionAnswer:
    """The answer of ``/v1/completions`` for n choices: one ``text_completion`` object, or
    (``stream``) its events — per choice a ``text`` delta per output chunk (the prompt before
    the first with ``echo``) and a last one with ``finish_reason``; then usage when asked,
    ``[DONE]``."""

    content_type = SSE_CONTENT_TYPE

    def __init__(
        self,
        pipeline: PipelineSpec,
        text_stage: int,
        *,
        usage: bool,
        logprobs: int | None,
        echo: bool,
        prompt_text: str | None,
    ) -> None:
        self.model = pipeline.name
        self.text_stage = text_stage
        self.include_usage = usage
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_text = prompt_text  # None: a token-id prompt (the engine detokenizes it)
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}

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
    def _choice(
        index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _text(self, outputs: list[FinalOutput]) -> FinalOutput | None:
        return next((o for o in outputs if o.stage_id == self.text_stage), None)

    def _shaped(self, output: FinalOutput, echo: bool, offset: int) -> tuple[str, Any, int]:
        """The choice's text (the prompt before it when ``echo``), its logprobs body (None:
        not asked or none given) and the text offset after it."""
        text = output.text or ""
        lp = output.logprobs
        if echo:
            prompt = self.prompt_text
            if prompt is None:
                given = (output.fields or {}).get("prompt_text")
                prompt = given if isinstance(given, str) else ""
            text = prompt + text
            if lp is not None and output.prompt_logprobs is not None:
                lp = output.prompt_logprobs + lp
        if self.logprobs is None or lp is None:
            return text, None, offset
        return text, lp.completion(self.logprobs, offset), lp.next_offset(offset)

    def piece(self, index: int, chunk: OutputChunk) -> bytes:
        # Every chunk is an event, its text empty when its tokens are no whole character yet
        # (as vLLM's server sends them).
        if chunk.stage_id != self.text_stage:
            return b""
        echo = self.echo and index not in self._echoed
        self._echoed.add(index)
        offset = self._offsets.get(index, 0)
        text, logprobs, self._offsets[index] = self._shaped(chunk.output, echo, offset)
        return sse(self._object([self._choice(index, text, None, logprobs)]))

    def end(self, index: int, outputs: list[FinalOutput]) -> bytes:
        reason = finish_reason(self._text(outputs))
        return sse(self._object([self._choice(index, "", reason, None)]))

    def tail(self, choices: list[list[FinalOutput]]) -> bytes:
        out = b""
        if self.include_usage:
            out += sse(self._object([], usage=usage_of([self._text(c) for c in choices])))
        return out + b"data: [DONE]\n\n"

    def unary(self, choices: list[list[FinalOutput]]) -> dict[str, Any]:
        body = []
        texts = [self._text(c) for c in choices]
        for index, output in enumerate(texts):
            if output is None:
                body.append(self._choice(index, "", finish_reason(None), None))
                continue
            text, logprobs, _ = self._shaped(output, self.echo, 0)
            body.append(self._choice(index, text, finish_reason(output), logprobs))
        return self._object(body, usage=usage_of(texts))

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
    prompt = Prompt(prompt=text, seed=req.seed, priority=req.priority)
    streams = []
    affinity = (
        named("cache", req.prompt_cache_key) or named("user", req.user) or prompt_prefix(req.prompt)
    )
    for choice in choice_prompts(prompt, req.n):
        si = entry(pod, request, choice, sampling, param="prompt", affinity=affinity)
        if token_ids is not None:
            ids = np.asarray(token_ids, dtype=np.int64)
            si.payload.tensors = {**si.payload.tensors, "token_ids": tensor_from_array(ids)}
        # The prompt as given, never chat-templated (as vLLM's server takes it); with echo the
        # engine gives the prompt's text (token ids) and logprobs (when asked).
        extra: dict[str, Scalar] = {"chat_template": False}
        if req.echo:
            extra["echo"] = True
        si.payload.fields = {**si.payload.fields, **extra}
        streams.append(request_frames(pod, request, si))
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    answer = CompletionAnswer(
        pod.pipeline,
        text_stage,
        usage=include_usage,
        logprobs=req.logprobs,
        echo=req.echo,
        prompt_text=None if token_ids is not None else text,
    )
    if req.stream:
        return await respond_choices(request, pod.pipeline, streams, answer)
    return web.json_response(answer.unary(await collect_choices(pod.pipeline, streams)))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
