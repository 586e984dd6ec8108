"""The text routes' streamed answers over real HTTP, for one choice and for n: a real aiohttp
server whose handler answers scripted answer frames (one script per choice) through
:func:`respond_choices` and the routes' sinks, read by aiohttp and by the official ``openai``
SDK. Chat chunks with audio, a text-only chat, an error event after the start, n choices merged
with their indexes and their own ends, and a client that leaves closing every choice's frames."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import HopResult, Payload, StageError
from omni_mesh.data_plane.tensors import payload_from_arrays
from omni_mesh.launcher.supervisor import free_port
from omni_mesh.sidecar.api.chat_answer import ChatEvents
from omni_mesh.sidecar.api.choices import ChoiceSink, respond_choices
from omni_mesh.sidecar.api.completions import CompletionAnswer
from omni_mesh.sidecar.middleware import error_middleware
from tests.sidecar.scripted import Script

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

OMNI = get_pipeline("tiny-omni")  # stage 0: text, stage 2: audio
RATE = 24000


def wave(chunk: int, n: int = 960) -> np.ndarray:
    t = np.arange(chunk * n, (chunk + 1) * n, dtype=np.float32)
    return np.asarray(0.5 * np.sin(t / 11.0), dtype=np.float32)


def audio_frame(chunk: int) -> HopResult:
    payload = payload_from_arrays({"sample_rate": RATE}, {"waveform": wave(chunk)})
    return HopResult(request_id="r", outputs={2: payload}, chunks={2: chunk}, more=True)


def text_frame(text: str, chunk: int, *, more: bool = True, **fields: int | str) -> HopResult:
    payload = Payload(fields={"text": text, **fields})
    return HopResult(request_id="r", outputs={0: payload}, chunks={0: chunk}, more=more)


END = HopResult(request_id="r")


Serve = Callable[[list[Script], Callable[[], ChoiceSink]], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """A real server whose every POST answers the scripts (a choice each) through a fresh sink."""
    servers: list[TestServer] = []

    async def start(scripts: list[Script], sink: Callable[[], ChoiceSink]) -> str:
        async def handle(request: web.Request) -> web.StreamResponse:
            streams = [s.frames() for s in scripts]
            return await respond_choices(request, OMNI, streams, sink())

        app = web.Application(middlewares=[error_middleware])
        app.router.add_post("/{tail:.*}", handle)
        server = TestServer(app, host="127.0.0.1", port=free_port(), handler_cancellation=True)
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


def events(body: bytes) -> list[dict[str, Any]]:
    assert body.endswith(b"data: [DONE]\n\n")
    out = []
    for block in body.removesuffix(b"data: [DONE]\n\n").decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            out.append(json.loads(block[len("data: ") :]))
    return out


async def post_events(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(url, json={}) as resp:
        return events(await resp.read())


def chat_sink(audio: bool = True, usage: bool = False) -> Callable[[], ChoiceSink]:
    return lambda: ChatEvents(OMNI, want_audio=audio, include_usage=usage, top_logprobs=None)


async def test_chat_stream_parses_with_the_openai_sdk(serve: Serve) -> None:
    frames = [text_frame("Hi there", 0), *(audio_frame(c) for c in range(3)), END]
    url = await serve([Script(frames)], chat_sink())
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "hi"}],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
    )
    chunks = [c async for c in stream]
    await client.close()
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    first = chunks[0].choices[0].delta
    assert (first.role, first.content) == ("assistant", "Hi there")
    audio = [c.choices[0].delta.audio for c in chunks[1:-1]]
    assert all(a is not None for a in audio) and len(audio) == 3
    want = b"".join(media.pcm_bytes(wave(c)) for c in range(3))
    assert b"".join(base64.b64decode(a.data or "") for a in audio if a) == want
    assert audio[0] is not None and audio[0].transcript == "Hi there"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


async def test_chat_stream_of_text_only_from_a_whole_answer(serve: Serve) -> None:
    whole = HopResult(
        request_id="r",
        outputs={0: Payload(fields={"text": "Whole"}), 2: audio_frame(0).outputs[2]},
    )
    url = await serve([Script([whole])], chat_sink(audio=False))
    got = await post_events(url + "/v1/chat/completions")
    deltas = [e["choices"][0]["delta"] for e in got]
    assert deltas == [{"role": "assistant", "content": "Whole"}, {}]


async def test_chat_stream_error_raises_in_the_sdk(serve: Serve) -> None:
    boom = HopResult(request_id="r", error=StageError("engine_error", "boom", 2))
    url = await serve([Script([text_frame("Hi", 0), boom])], chat_sink())
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(openai.APIError, match="stage 2: boom"):
        async for _ in stream:
            pass
    await client.close()


def counted(text: str, chunk: int, prompt: int, completion: int) -> HopResult:
    return text_frame(
        text,
        chunk,
        more=False,
        finish_reason="length",
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


async def test_n_chat_choices_stream_with_their_indexes_and_ends(serve: Serve) -> None:
    first = Script([text_frame("a", 0), text_frame("b", 1), counted("c", 2, 4, 3)], delay_s=0.05)
    second = Script([counted("xy", 0, 4, 2)], delay_s=0.01)  # ends long before the first
    url = await serve([first, second], chat_sink(audio=False, usage=True))
    got = await post_events(url + "/v1/chat/completions")
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for event in got[:-1]:
        (choice,) = event["choices"]
        by_index[choice["index"]].append(choice)
    text = {
        i: "".join(str(c["delta"].get("content") or "") for c in cs) for i, cs in by_index.items()
    }
    assert text == {0: "abc", 1: "xy"}
    assert [c["finish_reason"] for c in by_index[1]] == [None, "length"]
    assert by_index[0][-1]["finish_reason"] == "length"
    # The second choice ended (its finish event sent) while the first still streamed.
    ends = [i for i, e in enumerate(got[:-1]) if e["choices"][0]["finish_reason"]]
    assert got[ends[0]]["choices"][0]["index"] == 1
    assert got[-1]["choices"] == []
    assert got[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


async def test_n_completion_choices_with_echo(serve: Serve) -> None:
    scripts = [Script([counted("one", 0, 2, 1)]), Script([counted("two", 0, 2, 1)])]
    url = await serve(
        scripts,
        lambda: CompletionAnswer(
            OMNI, 0, usage=False, logprobs=None, echo=True, prompt_text="say: "
        ),
    )
    got = await post_events(url + "/v1/completions")
    texts: dict[int, str] = {}
    for event in got:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "say: one", 1: "say: two"}


async def test_an_error_in_one_choice_ends_the_stream_and_closes_the_others(
    serve: Serve,
) -> None:
    boom = HopResult(request_id="r", error=StageError("engine_error", "boom", 0))
    hanging = Script([text_frame("a", 0)], hang=True)
    failing = Script([text_frame("b", 0), boom], delay_s=0.1)
    url = await serve([hanging, failing], chat_sink(audio=False))
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/x", json={}) as r:
        body = await r.read()
    assert b'"error"' in body and b"boom" in body
    await asyncio.wait_for(hanging.closed.wait(), 5.0)
