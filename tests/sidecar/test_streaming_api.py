"""Streaming answers over real HTTP: a real aiohttp server whose handlers answer from scripted
answer frames through :func:`respond` and the routes' sinks, read by aiohttp and by the
official ``openai`` SDK. Chunked WAV/PCM speech, SSE speech, generate events (chat completion
chunks: ``test_text_choices.py``); errors before the response (a status) and after it (a cut
connection, an error event); a client that leaves closes the frame iterator."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import HopResult, Payload, StageError
from omni_mesh.data_plane.tensors import payload_from_arrays
from omni_mesh.launcher.supervisor import free_port
from omni_mesh.sidecar.api.sinks import (
    GenerateEvents,
    Sink,
    SpeechAudio,
    SpeechEvents,
    respond,
)
from omni_mesh.sidecar.hop.budget import HopUnavailable
from omni_mesh.sidecar.middleware import error_middleware
from tests import media_readers
from tests.sidecar.scripted import Item, Script

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TTS = get_pipeline("tiny-tts")  # stage 1: audio
RATE = 24000


def wave(chunk: int, n: int = 960) -> np.ndarray:
    t = np.arange(chunk * n, (chunk + 1) * n, dtype=np.float32)
    return np.asarray(0.5 * np.sin(t / 11.0), dtype=np.float32)


def audio_frame(stage: int, chunk: int, *, more: bool = True) -> HopResult:
    payload = payload_from_arrays({"sample_rate": RATE}, {"waveform": wave(chunk)})
    return HopResult(request_id="r", outputs={stage: payload}, chunks={stage: chunk}, more=more)


def streamed_audio(stage: int, n: int) -> list[Item]:
    return [*(audio_frame(stage, c) for c in range(n)), HopResult(request_id="r")]


def pcm(n: int) -> bytes:
    return b"".join(media.pcm_bytes(wave(c)) for c in range(n))


Serve = Callable[[Script, Callable[[], Sink]], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """A real server whose every POST answers ``script`` through a fresh sink; its base URL."""
    servers: list[TestServer] = []

    async def start(script: Script, sink: Callable[[], Sink]) -> str:
        pipeline = TTS

        async def handle(request: web.Request) -> web.StreamResponse:
            return await respond(request, pipeline, script.frames(), sink())

        app = web.Application(middlewares=[error_middleware])
        app.router.add_post("/{tail:.*}", handle)
        server = TestServer(app, host="127.0.0.1", port=free_port(), handler_cancellation=True)
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


async def post_pieces(url: str) -> tuple[aiohttp.ClientResponse, list[bytes]]:
    async with aiohttp.ClientSession() as session, session.post(url, json={}) as resp:
        pieces = [bytes(p) async for p in resp.content.iter_any()]
        return resp, pieces


def events(body: bytes) -> list[dict[str, object]]:
    out = []
    for block in body.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            out.append(json.loads(block[len("data: ") :]))
    return out


# ---- speech ----------------------------------------------------------------------------------


async def test_streamed_speech_is_a_wav_of_unknown_length_sent_as_it_comes(serve: Serve) -> None:
    url = await serve(Script(streamed_audio(1, 4), delay_s=0.08), lambda: SpeechAudio(1, "wav"))
    resp, pieces = await post_pieces(url + "/v1/audio/speech")
    assert resp.status == 200 and resp.content_type == "audio/wav"
    assert resp.headers.get("Transfer-Encoding") == "chunked"
    assert "Content-Length" not in resp.headers
    assert len(pieces) >= 3  # arrived as it was made, not at the end
    body = b"".join(pieces)
    assert body[:44] == media.wav_stream_header(RATE)
    assert body[44:] == pcm(4)  # the PCM16 of the joined waveform
    assert media_readers.read_wav(body)[0].size == 4 * 960


async def test_streamed_pcm_is_the_raw_samples(serve: Serve) -> None:
    url = await serve(Script(streamed_audio(1, 3)), lambda: SpeechAudio(1, "pcm"))
    resp, pieces = await post_pieces(url + "/v1/audio/speech")
    assert resp.content_type == "audio/pcm" and b"".join(pieces) == pcm(3)


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
async def test_a_unary_answer_is_the_whole_file_with_its_length(serve: Serve, fmt: str) -> None:
    url = await serve(Script([audio_frame(1, 0, more=False)]), lambda: SpeechAudio(1, fmt))
    resp, pieces = await post_pieces(url + "/v1/audio/speech")
    body = b"".join(pieces)
    assert resp.headers["Content-Length"] == str(len(body))
    assert body == (media.wav_bytes(wave(0), RATE) if fmt == "wav" else pcm(1))


async def test_an_error_before_any_audio_is_a_status(serve: Serve) -> None:
    text = HopResult(request_id="r", outputs={0: Payload(fields={"x": 1})}, more=True)
    late = HopResult(request_id="r", error=StageError("deadline", "too slow", 1))
    url = await serve(Script([text, late]), lambda: SpeechAudio(1, "wav"))
    resp, pieces = await post_pieces(url + "/v1/audio/speech")
    assert resp.status == 504
    assert json.loads(b"".join(pieces))["error"]["message"] == "stage 1: too slow"


@pytest.mark.parametrize(
    "failure",
    [
        HopResult(request_id="r", error=StageError("engine_error", "boom", 1)),
        HopUnavailable(1, "no replica of stage 1"),
        RuntimeError("a bug"),
    ],
    ids=["error-frame", "unavailable", "bug"],
)
async def test_a_failure_after_the_headers_cuts_the_connection(serve: Serve, failure: Item) -> None:
    url = await serve(Script([audio_frame(1, 0), failure]), lambda: SpeechAudio(1, "wav"))
    received = b""
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/audio/speech") as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for piece in resp.content.iter_any():
                received += piece
    assert received == media.wav_stream_header(RATE) + pcm(1)  # truncated, never wrong


async def test_sse_speech_sends_pcm16_deltas_then_done(serve: Serve) -> None:
    url = await serve(Script(streamed_audio(1, 3)), lambda: SpeechEvents(1))
    resp, pieces = await post_pieces(url + "/v1/audio/speech")
    assert resp.content_type == "text/event-stream"
    got = events(b"".join(pieces))
    assert [e["type"] for e in got] == ["speech.audio.delta"] * 3 + ["speech.audio.done"]
    assert b"".join(base64.b64decode(str(e["audio"])) for e in got[:3]) == pcm(3)


async def test_sse_speech_ends_with_an_error_event(serve: Serve) -> None:
    boom = HopResult(request_id="r", error=StageError("engine_error", "boom", 1))
    url = await serve(Script([audio_frame(1, 0), boom]), lambda: SpeechEvents(1))
    _, pieces = await post_pieces(url + "/v1/audio/speech")
    got = events(b"".join(pieces))
    assert got[-1] == {
        "type": "error",
        "error": {"message": "stage 1: boom", "type": "engine_error", "param": None, "code": 500},
    }


# ---- generate and disconnects ----------------------------------------------------------------


async def test_generate_events_carry_each_chunk_in_order(serve: Serve) -> None:
    items: list[Item] = [audio_frame(1, 1), audio_frame(1, 0), HopResult(request_id="r")]
    url = await serve(Script(items), lambda: GenerateEvents(TTS))
    _, pieces = await post_pieces(url + "/v1/generate?stream=true")
    got = events(b"".join(pieces))
    assert [(e["type"], e.get("chunk")) for e in got] == [
        ("output.chunk", 0),
        ("output.chunk", 1),
        ("done", None),
    ]
    output = got[0]["output"]
    assert isinstance(output, dict) and output["kind"] == "audio"
    assert base64.b64decode(output["data"]) == media.wav_bytes(wave(0), RATE)


async def test_a_client_that_leaves_closes_the_frames(serve: Serve) -> None:
    script = Script([audio_frame(1, 0), audio_frame(1, 1)], hang=True)
    url = await serve(script, lambda: SpeechAudio(1, "wav"))
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/audio/speech") as resp:
        assert resp.status == 200
        await resp.content.readexactly(44)
    await asyncio.wait_for(script.closed.wait(), 5.0)
