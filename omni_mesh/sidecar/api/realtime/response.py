"""One realtime response: the pipeline run on the session's conversation, its chunks streamed
to the socket as GA server events while the stages make them.

The events of a response, in order: ``response.created``, ``response.output_item.added``,
``conversation.item.added``, ``response.content_part.added``, then per chunk
``response.output_audio_transcript.delta`` (the text stage) and ``response.output_audio.delta``
(the audio stage, resampled and encoded to the session's output format), or
``response.output_text.delta`` for a text response; at the end the ``...done`` events and
``response.done`` with its status: ``completed``, ``incomplete`` (``max_output_tokens``),
``cancelled`` (``turn_detected`` or ``client_cancelled``) or ``failed`` (with the error).

A cancel (:meth:`ResponseRun.cancel`) cancels the task that reads the answer frames: closing
the frame iterator aborts the request at every stage holding its work (the same path as a
client that goes away), and the audio deltas still queued for the socket are dropped, so no
audio delta follows ``response.done(cancelled)``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from omni_mesh.configs.pipeline_spec import OutputKind
from omni_mesh.data_plane.messages import Prompt
from omni_mesh.observability.audio_slo import AudioPlayback
from omni_mesh.sidecar.api.affinity_keys import named
from omni_mesh.sidecar.api.client_requests import entry, request_frames
from omni_mesh.sidecar.api.outputs import ChunkAssembler, OutputChunk, final_stage
from omni_mesh.sidecar.api.realtime import audio_formats
from omni_mesh.sidecar.api.realtime.config import SessionConfig
from omni_mesh.sidecar.api.realtime.conversation import Conversation, Item, Part, new_id
from omni_mesh.sidecar.api.realtime.sender import EventSender
from omni_mesh.sidecar.api.time_stretch import SpeechPace
from omni_mesh.sidecar.api.usage import Usage
from omni_mesh.sidecar.errors import ApiError
from omni_mesh.sidecar.pod import Pod

logger = logging.getLogger(__name__)


@dataclass
class ResponseInput:
    """What a response runs on (the session builds it from its conversation)."""

    config: SessionConfig
    prompt: str
    messages_json: str
    previous_item_id: str | None
    session_id: str = ""  # the session's: its responses keep to one replica per stage
    audio_in_s: float = 0.0  # the input audio of the conversation the prompt carries (usage)


@dataclass
class ResponseStats:
    """Timings of one response (the benchmark and the trace read them)."""

    started: float = field(default_factory=time.perf_counter)
    first_audio_s: float | None = None
    first_text_s: float | None = None
    cancelled_at: float | None = None
    done_at: float | None = None
    audio_ms: float = 0.0


class ResponseRun:
    """One response's task and events (see the module docstring)."""

    def __init__(
        self,
        pod: Pod,
        request: web.Request,
        sender: EventSender,
        conversation: Conversation,
        inp: ResponseInput,
        *,
        on_done: Callable[[ResponseRun], None],
    ) -> None:
        self.pod, self.request, self.sender = pod, request, sender
        self.conversation = conversation
        self.inp = inp
        self.on_done = on_done
        self.id = new_id("resp")
        self.item_id = new_id("item")
        self.audio = inp.config.output_modalities == ["audio"]
        self.text_stage = final_stage(pod.pipeline, OutputKind.TEXT)
        self.audio_stage = final_stage(pod.pipeline, OutputKind.AUDIO) if self.audio else None
        self.status = "in_progress"
        self.reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.stats = ResponseStats()
        self.playback = AudioPlayback(started=time.monotonic())  # its audio SLOs
        self.usage = Usage(audio_in_s=inp.audio_in_s)  # what it used (response.done's usage)
        self.tenant = ""  # the response's tenant (its request's), once it runs
        self.transcript: list[str] = []
        self.text_fields: dict[str, Any] = {}
        self.item: Item | None = None
        self._resampler: audio_formats.StreamResampler | None = None
        self._pace = SpeechPace(inp.config.speed)  # session.audio.output.speed
        self._audio_rate = 0  # the audio stage's sample rate, once it has sent some
        self.task: asyncio.Task[None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._begin()  # the response and its item exist before anything can cancel them
        self.task = asyncio.create_task(self._run(), name=f"realtime-{self.id}")

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    def cancel(self, reason: str) -> bool:
        """End the response as ``cancelled`` for ``reason``; False when it had ended."""
        if self.done or self.reason is not None or self.task is None:
            return False
        self.reason = reason
        self.stats.cancelled_at = time.perf_counter()
        self.stats.audio_ms -= self.sender.discard(self.id)  # what the client never got
        # response.done now, not when the task has unwound: nothing of this response follows
        # it, and the stages abort in the background as the frame iterator closes.
        self._finish("cancelled")
        self.task.cancel()
        return True

    async def wait(self) -> None:
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self.task)

    # ---- the run -----------------------------------------------------------------------------

    def _prompt(self) -> Prompt:
        config, fields = self.inp.config, self.pod.pipeline.prompt_fields
        extra: dict[str, Any] = {}
        if isinstance(config.max_output_tokens, int) and "max_tokens" in fields:
            extra["max_tokens"] = min(config.max_output_tokens, 8192)
        if self.audio and config.voice is not None and "voice" in fields:
            extra["voice"] = config.voice
        # the response's id names its work at every stage (metrics, logs, the trace)
        return Prompt(prompt=self.inp.prompt[-32_768:], request_id=self.id, **extra)

    async def _run(self) -> None:
        try:
            affinity = named("realtime", self.inp.session_id)
            si = entry(self.pod, self.request, self._prompt(), affinity=affinity)
            si.payload.fields = {**si.payload.fields, "messages": self.inp.messages_json}
            if not self.audio and self.text_stage is not None:  # the audio stages need not run
                si.final_stages = (self.text_stage,)
            self.tenant = si.tenant
            assembler = ChunkAssembler(self.pod.pipeline)
            frames = request_frames(
                self.pod, self.request, si, self.playback.attributes, self.usage
            )
            async with contextlib.aclosing(frames) as stream:
                async for frame in stream:
                    for chunk in assembler.add(frame):
                        self._chunk(chunk)
                    if assembler.error is not None:
                        break
            error = assembler.end()
            rest = self._pace.rest()  # the end of a time-stretched answer
            if len(rest) and error is None:
                self._audio(rest, self._audio_rate, time.perf_counter() - self.stats.started)
            if error is not None:
                self._failed(error.code, f"stage {error.stage_id}: {error.message}")
            else:
                finish = self.text_fields.get("finish_reason")
                self._finish("incomplete" if finish == "length" else "completed")
        except asyncio.CancelledError:
            if self.reason is None:  # the session is closing: nothing more to say
                self.status = "cancelled"
                raise
        except ApiError as exc:
            self._failed(exc.type, exc.message)
        except Exception as exc:  # a failure of this response, not of the session
            logger.exception("realtime response %s failed", self.id)
            self._failed("server_error", f"{type(exc).__name__}: {exc}")
        finally:
            self.stats.done_at = time.perf_counter()
            self.on_done(self)

    def _base(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0}

    def _response(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        config = self.inp.config
        details: dict[str, Any] | None = None
        if self.status == "cancelled":
            details = {"type": "cancelled", "reason": self.reason}
        elif self.status == "incomplete":
            details = {"type": "incomplete", "reason": "max_output_tokens"}
        elif self.status == "failed":
            details = {"type": "failed", "error": self.error}
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": self.status,
            "status_details": details,
            "output": output,
            "conversation_id": None,
            "output_modalities": list(config.output_modalities),
            "max_output_tokens": config.max_output_tokens,
            "audio": {"output": {"format": {"type": config.output_format}, "voice": config.voice}},
            "usage": self._usage() if self.done else None,
            "metadata": None,
        }

    def _usage(self) -> dict[str, Any]:
        p = self.text_fields.get("prompt_tokens")
        c = self.text_fields.get("completion_tokens")
        p, c = (p if isinstance(p, int) else 0), (c if isinstance(c, int) else 0)
        return {
            "input_tokens": p,
            "output_tokens": c,
            "total_tokens": p + c,
            "omni": self.usage.extension(),
        }

    def _part_type(self) -> str:
        return "audio" if self.audio else "text"

    def _begin(self) -> None:
        self.sender.send({"type": "response.created", "response": self._response([])})
        part = Part(type="output_audio", transcript="") if self.audio else Part("output_text", "")
        self.item = Item(id=self.item_id, role="assistant", parts=[part], status="in_progress")
        self.conversation.add(self.item, None)
        wire = self.item.wire()
        self.sender.send(
            {
                "type": "response.output_item.added",
                "response_id": self.id,
                "output_index": 0,
                "item": wire,
            }
        )
        self.sender.send(
            {
                "type": "conversation.item.added",
                "previous_item_id": self.inp.previous_item_id,
                "item": wire,
            }
        )
        empty = {"type": self._part_type(), "transcript" if self.audio else "text": ""}
        self.sender.send(
            {
                "type": "response.content_part.added",
                **self._base(),
                "content_index": 0,
                "part": empty,
            }
        )

    def _chunk(self, chunk: OutputChunk) -> None:
        now = time.perf_counter() - self.stats.started
        if chunk.stage_id == self.text_stage:
            text = chunk.output.text or ""
            self.text_fields.update(chunk.output.fields or {})
            if not text:
                return
            self.transcript.append(text)
            if self.stats.first_text_s is None:
                self.stats.first_text_s = now
            kind = (
                "response.output_audio_transcript.delta"
                if self.audio
                else ("response.output_text.delta")
            )
            self.sender.send({"type": kind, **self._base(), "content_index": 0, "delta": text})
            return
        if chunk.stage_id != self.audio_stage or chunk.output.array is None:
            return
        self._audio_rate = chunk.sample_rate
        wave = self._pace.stream(chunk.output.array.reshape(-1), chunk.sample_rate)
        self._audio(wave, chunk.sample_rate, now)

    def _audio(self, wave: np.ndarray, source_rate: int, now: float) -> None:
        """Send ``wave`` (at ``source_rate``) in the session's output format."""
        fmt = self.inp.config.output_format
        rate = audio_formats.format_rate(fmt)
        if self._resampler is None or self._resampler.source_rate != source_rate:
            self._resampler = audio_formats.StreamResampler(source_rate, rate)
        samples = self._resampler.feed(wave)
        if len(samples) == 0:
            return
        if self.stats.first_audio_s is None:
            self.stats.first_audio_s = now
        ms = len(samples) * 1000.0 / rate
        self.stats.audio_ms += ms
        self.playback.sent(ms / 1000.0, time.monotonic())
        delta = base64.b64encode(audio_formats.encode(fmt, samples)).decode()
        self.sender.send(
            {
                "type": "response.output_audio.delta",
                **self._base(),
                "content_index": 0,
                "delta": delta,
            },
            response_id=self.id,
            audio_ms=ms,
        )

    def _failed(self, code: str, message: str) -> None:
        self.error = {"type": "server_error", "code": code, "message": message}
        self._finish("failed")

    def _finish(self, status: str) -> None:
        self.status = status
        text = "".join(self.transcript)
        item = self.item
        if item is None:  # failed before it began
            self.sender.send({"type": "response.done", "response": self._response([])})
            return
        part = item.parts[0]
        if self.audio:
            part.transcript, part.audio_ms = text, int(self.stats.audio_ms)
        else:
            part.text = text
        item.status = "completed" if status == "completed" else "incomplete"
        base = {**self._base(), "content_index": 0}
        if status != "cancelled":  # a cancelled stream's content just stops
            if self.audio:
                self.sender.send({"type": "response.output_audio.done", **base})
                self.sender.send(
                    {"type": "response.output_audio_transcript.done", **base, "transcript": text}
                )
            else:
                self.sender.send({"type": "response.output_text.done", **base, "text": text})
        done_part = (
            {"type": "audio", "transcript": text} if self.audio else {"type": "text", "text": text}
        )
        self.sender.send({"type": "response.content_part.done", **base, "part": done_part})
        wire = item.wire()
        self.sender.send(
            {
                "type": "response.output_item.done",
                "response_id": self.id,
                "output_index": 0,
                "item": wire,
            }
        )
        self.sender.send({"type": "conversation.item.done", "item": wire})
        self.sender.send({"type": "response.done", "response": self._response([wire])})
