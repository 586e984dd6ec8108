"""Answering a client request from its stream of answer frames, through a :class:`Sink` that
says what each output chunk looks like on the wire (WAV/PCM audio, OpenAI's SSE events).

The response starts lazily, at the first bytes a sink has to send: an error before that is an
ordinary 4xx/5xx; an error after it is an error event where the format has one (SSE), else a
cut connection (the client sees a truncated body, never a wrong one).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Protocol

import msgspec
import numpy as np
from aiohttp import web

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane import codec, media
from omni_mesh.data_plane.messages import HopResult
from omni_mesh.sidecar.api.outputs import (
    ChunkAssembler,
    FinalOutput,
    OutputChunk,
    joined_off_loop,
)
from omni_mesh.sidecar.api.playback import Playbacks
from omni_mesh.sidecar.api.time_stretch import SpeechPace
from omni_mesh.sidecar.api.usage import Usage
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.errors import (
    ApiError,
    error_body,
    from_stage_error,
    hop_unavailable_error,
)
from omni_mesh.sidecar.hop.budget import HopUnavailable
from omni_mesh.sidecar.middleware import API_ROUTE, API_STARTED, STREAM_FAILED, internal_error

logger = logging.getLogger(__name__)

SSE_CONTENT_TYPE = "text/event-stream"


class Sink(Protocol):
    """What one route sends for a request's output chunks."""

    content_type: str
    always_stream: bool  # True (SSE): a stream even when the answer is one frame
    encodes: bool  # piece() encodes media (WAV per chunk): run it off the event loop

    def piece(self, chunk: OutputChunk) -> bytes:
        """The bytes to send for a chunk, as soon as it is in order (b"": nothing)."""
        ...

    def unary(self, outputs: list[FinalOutput]) -> web.StreamResponse:
        """The whole answer, when nothing was streamed (``always_stream`` False)."""
        ...

    def tail(self, outputs: list[FinalOutput]) -> bytes:
        """The last bytes of a stream (the joined outputs at hand)."""
        ...

    def error_event(self, err: ApiError) -> bytes:
        """An error after the response started (b"": none; the connection is cut)."""
        ...


class _LazyResponse:
    """A chunked response prepared at its first bytes."""

    def __init__(self, request: web.Request, sink: Sink) -> None:
        self.request = request
        self.sink = sink
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self.response is None:
            headers = {"Content-Type": self.sink.content_type, "Cache-Control": "no-cache"}
            response = web.StreamResponse(headers=headers)  # no length: chunked (HTTP/1.1)
            await response.prepare(self.request)
            self.response = response
            started = self.request.get(API_STARTED)
            if started is not None:  # the first-packet latency operators watch
                metrics = self.request.app[POD].metrics
                route = self.request.get(API_ROUTE, self.request.path)
                metrics.api_first_chunk.labels(route).observe(time.monotonic() - started)
        await self.response.write(data)

    async def finish(self) -> web.StreamResponse:
        assert self.response is not None
        await self.response.write_eof()
        return self.response

    async def fail(self, err: ApiError) -> web.StreamResponse:
        """End a started response on an error: an error event, or a cut connection."""
        assert self.response is not None
        self.request[STREAM_FAILED] = True
        event = self.sink.error_event(err)
        if event:
            with contextlib.suppress(ConnectionResetError):
                await self.response.write(event)
                await self.response.write_eof()
                return self.response
        self.cut()
        return self.response

    def cut(self) -> None:
        transport = self.request.transport
        if transport is not None:
            transport.close()  # no last chunk: the client sees an incomplete body


async def respond(
    request: web.Request,
    pipeline: PipelineSpec,
    frames: AsyncGenerator[HopResult, None],
    sink: Sink,
) -> web.StreamResponse:
    """Answer ``request`` from ``frames`` through ``sink`` (see the module docstring)."""
    assembler = ChunkAssembler(pipeline)
    out = _LazyResponse(request, sink)
    try:
        async with contextlib.aclosing(frames) as stream:
            async for frame in stream:
                ready = assembler.add(frame)
                if assembler.error is not None:
                    break
                if sink.always_stream or assembler.streamed:
                    await out.write(await _pieces(sink, ready))
        error = assembler.end()
        if error is not None:
            raise from_stage_error(error)
        outputs = await joined_off_loop(assembler)
        if not out.started and not sink.always_stream:
            if sink.encodes:  # re-encoding a whole answer (a stretched speech) is compute
                return await asyncio.to_thread(sink.unary, outputs)
            return sink.unary(outputs)
        await out.write(sink.tail(outputs))
        return await out.finish()
    except Exception as exc:
        if out.response is None:
            raise
        return await stream_failed(request, out, exc)


async def stream_failed(
    request: web.Request, out: _LazyResponse, exc: Exception
) -> web.StreamResponse:
    """The end of a streamed answer whose response has started when ``exc`` happened: a
    client that went away is logged and the connection cut; any other failure ends the stream
    with an error event (the status line was sent already)."""
    assert out.response is not None  # the caller re-raises when nothing was sent
    if isinstance(exc, ConnectionResetError):
        logger.info("client went away: %s %s", request.method, request.path)
        out.cut()
        return out.response
    err = _api_error(exc)
    logger.warning(
        "stream of %s %s failed after the response started: %s",
        request.method,
        request.path,
        err.message,
        exc_info=not isinstance(exc, ApiError | HopUnavailable),
    )
    return await out.fail(err)


async def _pieces(sink: Sink, chunks: list[OutputChunk]) -> bytes:
    """What ``sink`` sends for ``chunks``; encoded in a worker thread when the sink encodes."""
    if not chunks:
        return b""
    if sink.encodes:
        return await asyncio.to_thread(lambda: b"".join(sink.piece(c) for c in chunks))
    return b"".join(sink.piece(c) for c in chunks)


def _api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, HopUnavailable):
        return hop_unavailable_error(exc)
    return internal_error()


def sse(event: object) -> bytes:
    """One server-sent event carrying ``event`` as JSON."""
    return b"data: " + codec.encode_json(event) + b"\n\n"


def _delta(samples: np.ndarray) -> bytes:
    audio = base64.b64encode(media.pcm_bytes(samples)).decode()
    return sse({"type": "speech.audio.delta", "audio": audio})


class SpeechAudio:
    """``/v1/audio/speech`` audio: streamed as a WAV of unknown length (or raw PCM16) when the
    pipeline streams and the request asked for a stream (``streams``); otherwise the whole file
    with its true lengths, once the answer is complete. At a ``speed`` other than 1 the samples
    are time-stretched (``time_stretch.py``)."""

    always_stream = False

    def __init__(
        self,
        audio_stage: int,
        response_format: str,
        speed: float = 1.0,
        *,
        streams: bool = True,
        playbacks: Playbacks | None = None,
    ) -> None:
        self.audio_stage = audio_stage
        self.streams = streams
        self.playbacks = playbacks  # the streamed answer's audio SLOs
        self.raw = response_format == "pcm"
        self.content_type = "audio/pcm" if self.raw else "audio/wav"
        self.pace = SpeechPace(speed)
        self.encodes = speed != 1.0  # stretching is compute: off the event loop
        self._rate = 0  # the sample rate of the stream, once its first piece is sent

    def piece(self, chunk: OutputChunk) -> bytes:
        if not self.streams or chunk.stage_id != self.audio_stage or chunk.output.array is None:
            return b""  # not streamed: the whole answer goes at its end (unary)
        rate = chunk.sample_rate
        return self._send(self.pace.stream(chunk.output.array, rate), rate)

    def _send(self, samples: np.ndarray, rate: int) -> bytes:
        if self.playbacks is not None:
            self.playbacks.sent(len(samples), rate)
        data = media.pcm_bytes(samples)
        if not self.raw and not self._rate:
            data = media.wav_stream_header(rate) + data
        self._rate = rate
        return data

    def unary(self, outputs: list[FinalOutput]) -> web.StreamResponse:
        audio = next((o for o in outputs if o.stage_id == self.audio_stage), None)
        if audio is None or audio.data is None or audio.array is None:
            raise ApiError(500, f"stage {self.audio_stage}: no audio output", type_="engine_error")
        rate = int((audio.fields or {}).get("sample_rate") or 24000)
        if self.raw:
            samples = self.pace.whole(audio.array, rate)
            return web.Response(body=media.pcm_bytes(samples, rate), content_type="audio/pcm")
        if self.pace.speed == 1.0:
            return web.Response(body=audio.data, content_type="audio/wav")
        wav = media.wav_bytes(self.pace.whole(audio.array, rate), rate)
        return web.Response(body=wav, content_type="audio/wav")

    def tail(self, outputs: list[FinalOutput]) -> bytes:
        rest = self.pace.rest()
        return self._send(rest, self._rate or 24000) if len(rest) else b""

    def error_event(self, err: ApiError) -> bytes:
        return b""


class SpeechEvents:
    """``/v1/audio/speech`` with ``stream_format: "sse"``: base64 PCM16 deltas, then done."""

    always_stream = True
    encodes = False
    content_type = SSE_CONTENT_TYPE

    def __init__(
        self,
        audio_stage: int,
        speed: float = 1.0,
        *,
        playbacks: Playbacks | None = None,
        usage: Usage | None = None,
    ) -> None:
        self.audio_stage = audio_stage
        self.pace = SpeechPace(speed)
        self.encodes = speed != 1.0  # stretching is compute: off the event loop
        self.playbacks = playbacks  # the streamed answer's audio SLOs
        self.usage = usage  # what the request used (the done event's usage.omni)
        self._rate = 24000

    def piece(self, chunk: OutputChunk) -> bytes:
        if chunk.stage_id != self.audio_stage or chunk.output.array is None:
            return b""
        self._rate = chunk.sample_rate
        samples = self.pace.stream(chunk.output.array, chunk.sample_rate)
        return self._sent(samples) if len(samples) else b""  # the stretcher may hold it all

    def _sent(self, samples: np.ndarray) -> bytes:
        if self.playbacks is not None:
            self.playbacks.sent(len(samples), self._rate)
        return _delta(samples)

    def unary(self, outputs: list[FinalOutput]) -> web.StreamResponse:
        raise AssertionError("an event stream is always streamed")

    def tail(self, outputs: list[FinalOutput]) -> bytes:
        rest = self.pace.rest()
        usage: dict[str, object] = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        if self.usage is not None:
            usage["omni"] = self.usage.extension()
        done = sse({"type": "speech.audio.done", "usage": usage})
        return self._sent(rest) + done if len(rest) else done

    def error_event(self, err: ApiError) -> bytes:
        return sse({"type": "error", "error": error_body(err)})


class GenerateEvents:
    """``/v1/generate?stream=true``: one event per output chunk, in order per stage
    (``{"type": "output.chunk", "stage_id", "chunk", "output"}``, the output as ``/v1/run``
    shows a chunk's), then ``{"type": "done"}``."""

    always_stream = True
    encodes = True  # each audio chunk as a WAV file
    content_type = SSE_CONTENT_TYPE

    def __init__(self, pipeline: PipelineSpec) -> None:
        self.pipeline = pipeline.name

    def piece(self, chunk: OutputChunk) -> bytes:
        output = msgspec.to_builtins(chunk.output.encoded().to_run_output())
        event = {"type": "output.chunk", "stage_id": chunk.stage_id, "chunk": chunk.chunk}
        return sse({**event, "output": output})

    def unary(self, outputs: list[FinalOutput]) -> web.StreamResponse:
        raise AssertionError("an event stream is always streamed")

    def tail(self, outputs: list[FinalOutput]) -> bytes:
        return sse({"type": "done", "pipeline": self.pipeline})

    def error_event(self, err: ApiError) -> bytes:
        return sse({"type": "error", "error": error_body(err)})
