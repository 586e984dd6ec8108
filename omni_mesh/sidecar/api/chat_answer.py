"""The answers of ``/v1/chat/completions``: one ``chat.completion`` object, or its
``chat.completion.chunk`` events, for n choices (see ``choices.py``).

Streamed as OpenAI (and vLLM's server) send them: per choice, the role with its first delta,
the text as ``content`` deltas (with their tokens' ``logprobs`` when asked), the audio (when
asked for) as ``delta.audio`` PCM16 chunks, a last chunk with ``finish_reason`` as soon as the
choice ends; then a ``usage`` chunk when ``stream_options.include_usage``, then ``[DONE]``.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec
from omni_mesh.data_plane import media
from omni_mesh.sidecar.api.openai_text import finish_reason, usage_of
from omni_mesh.sidecar.api.outputs import FinalOutput, OutputChunk, final_stage
from omni_mesh.sidecar.api.playback import Playbacks
from omni_mesh.sidecar.api.sinks import SSE_CONTENT_TYPE, sse
from omni_mesh.sidecar.api.usage import Usage, merged
from omni_mesh.sidecar.errors import ApiError, error_body


def _pick(outputs: list[FinalOutput], kind: OutputKind) -> FinalOutput | None:
    return next((o for o in outputs if o.kind is kind), None)


def _logprobs(text: FinalOutput | None, top_logprobs: int | None) -> dict[str, Any] | None:
    """Chat's ``logprobs`` (None: not asked, or the engine gave none)."""
    if top_logprobs is None or text is None or text.logprobs is None:
        return None
    return text.logprobs.chat(top_logprobs)


def chat_completion(
    pipeline: PipelineSpec,
    choices: list[list[FinalOutput]],
    *,
    want_audio: bool,
    top_logprobs: int | None,
) -> dict[str, Any]:
    """The unary ``chat.completion`` object of n choices' outputs."""
    body = []
    texts = []
    for index, outputs in enumerate(choices):
        text = _pick(outputs, OutputKind.TEXT)
        texts.append(text)
        message: dict[str, Any] = {"role": "assistant", "content": text.text if text else None}
        audio = _pick(outputs, OutputKind.AUDIO)
        if want_audio and audio is not None and audio.data is not None:
            message["audio"] = {
                "id": f"audio_{uuid.uuid4().hex}",
                "data": base64.b64encode(audio.data).decode(),
                "expires_at": int(time.time()) + 3600,
                "transcript": text.text if text and text.text else "",
            }
        body.append(
            {
                "index": index,
                "message": message,
                "finish_reason": finish_reason(text),
                "logprobs": _logprobs(text, top_logprobs),
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": pipeline.name,
        "choices": body,
        "usage": usage_of(texts),
    }


class ChatEvents:
    """``/v1/chat/completions`` with ``stream: true`` (see the module docstring)."""

    content_type = SSE_CONTENT_TYPE

    def __init__(
        self,
        pipeline: PipelineSpec,
        *,
        want_audio: bool,
        include_usage: bool,
        top_logprobs: int | None,
        playbacks: Playbacks | None = None,
        usages: list[Usage] | None = None,
    ) -> None:
        self.model = pipeline.name
        self.playbacks = playbacks  # the streamed audio's SLOs, per choice
        self.usages = usages or []  # what each choice used (usage.omni)
        self.text_stage = final_stage(pipeline, OutputKind.TEXT)
        self.audio_stage = final_stage(pipeline, OutputKind.AUDIO) if want_audio else None
        self.include_usage = include_usage
        self.top_logprobs = top_logprobs
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._role_sent: set[int] = set()
        self._text: dict[int, list[str]] = {}
        self._audio_id: dict[int, str] = {}

    def _event(self, choices: list[dict[str, object]], **extra: object) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        )

    def _delta(
        self,
        index: int,
        delta: dict[str, object],
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        if index not in self._role_sent:
            delta = {"role": "assistant", **delta}
            self._role_sent.add(index)
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return self._event([choice])

    def piece(self, index: int, chunk: OutputChunk) -> bytes:
        if chunk.stage_id == self.text_stage:
            text = chunk.output.text or ""
            self._text.setdefault(index, []).append(text)
            logprobs = _logprobs(chunk.output, self.top_logprobs)
            return self._delta(index, {"content": text}, logprobs=logprobs)
        if chunk.stage_id != self.audio_stage:
            return b""
        pcm = b"" if chunk.output.array is None else media.pcm_bytes(chunk.output.array)
        if self.playbacks is not None:
            self.playbacks.sent(len(pcm) // 2, chunk.sample_rate, index)
        audio: dict[str, object] = {"data": base64.b64encode(pcm).decode()}
        if index not in self._audio_id:
            self._audio_id[index] = f"audio_{uuid.uuid4().hex}"
            audio["expires_at"] = int(time.time()) + 3600
            audio["transcript"] = "".join(self._text.get(index, []))
        audio["id"] = self._audio_id[index]
        return self._delta(index, {"audio": audio})

    def end(self, index: int, outputs: list[FinalOutput]) -> bytes:
        text = next((o for o in outputs if o.stage_id == self.text_stage), None)
        out = b"" if index in self._role_sent else self._delta(index, {"content": ""})
        return out + self._delta(index, {}, finish_reason(text))

    def tail(self, choices: list[list[FinalOutput]]) -> bytes:
        out = b""
        if self.include_usage:
            texts = [next((o for o in c if o.stage_id == self.text_stage), None) for c in choices]
            usage: dict[str, object] = {**usage_of(texts)}
            if self.usages:
                usage["omni"] = merged(self.usages).extension()
            out += self._event([], usage=usage)
        return out + b"data: [DONE]\n\n"

    def error_event(self, err: ApiError) -> bytes:
        return sse({"error": error_body(err)})
