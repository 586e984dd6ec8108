"""Nothing blocks the pod's event loop (blockbuster).

A real aiohttp server on uvloop (as in the pod) answers client requests through the pod's own
answer path (``sinks.respond``, ``client_requests.collect``): streamed and whole WAV audio, a
PNG image. Under :func:`strict_loop` any blocking call (file and socket I/O, ``time.sleep``,
locks, …) made on the loop by ``omni_mesh`` code raises ``BlockingError``, and so do the media
encoders, which are CPU work of milliseconds per output: they must run off the loop. The pod's
start-up sweep of orphaned shared memory (a directory scan) is checked the same way.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import uvloop
from aiohttp import web
from blockbuster import BlockBuster, BlockBusterFunction, BlockingError, blockbuster_ctx

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import HopResult
from omni_mesh.data_plane.tensors import payload_from_arrays
from omni_mesh.procutil import free_port
from omni_mesh.sidecar.api.client_requests import collect
from omni_mesh.sidecar.api.outputs import FinalOutput, final_output
from omni_mesh.sidecar.api.sinks import SpeechAudio, respond
from omni_mesh.sidecar.app import sweep_orphaned_shm
from omni_mesh.sidecar.middleware import error_middleware
from tests.media_readers import read_png, read_wav

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TTS = get_pipeline("tiny-tts")  # stage 1: audio
IMAGE = get_pipeline("tiny-image")  # stage 1: image
ENCODERS = ("wav_bytes", "png_bytes", "join_wavs")


@contextmanager
def strict_loop() -> Iterator[BlockBuster]:
    """blockbuster over ``omni_mesh``, the media encoders counted as blocking calls."""
    with blockbuster_ctx("omni_mesh") as bb:
        for name in ENCODERS:
            fn = BlockBusterFunction(media, name, scanned_modules="omni_mesh")
            bb.functions[f"omni_mesh.data_plane.media.{name}"] = fn.activate()
        yield bb


def wave(chunk: int, n: int = 4800) -> np.ndarray:
    t = np.arange(chunk * n, (chunk + 1) * n, dtype=np.float32)
    return np.asarray(0.5 * np.sin(t / 11.0), dtype=np.float32)


def audio(chunk: int, *, more: bool) -> HopResult:
    payload = payload_from_arrays({"sample_rate": 24000}, {"waveform": wave(chunk)})
    return HopResult(request_id="r", outputs={1: payload}, chunks={1: chunk}, more=more)


IMAGE_PIXELS = np.arange(64 * 64 * 3, dtype=np.uint32).astype(np.uint8).reshape(64, 64, 3)


def image() -> HopResult:
    payload = payload_from_arrays({}, {"image": IMAGE_PIXELS})
    return HopResult(request_id="r", outputs={1: payload})


async def frames(items: list[HopResult]) -> AsyncGenerator[HopResult, None]:
    for item in items:
        await asyncio.sleep(0)
        yield item


def app() -> web.Application:
    """Each route answers scripted frames through the pod's answer path."""

    def speech(items: list[HopResult]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await respond(request, TTS, frames(items), SpeechAudio(1, "wav"))

        return handle

    async def generate(request: web.Request) -> web.Response:
        pipeline: PipelineSpec = IMAGE
        outputs = await collect(pipeline, frames([image()]))
        return web.json_response({"png": base64.b64encode(outputs[0].data or b"").decode()})

    application = web.Application(middlewares=[error_middleware])
    application.router.add_post("/whole", speech([audio(0, more=False)]))
    streamed = [audio(c, more=True) for c in range(3)] + [HopResult(request_id="r")]
    application.router.add_post("/streamed", speech(streamed))
    application.router.add_post("/image", generate)
    return application


async def serve_and_ask() -> dict[str, bytes]:
    runner = web.AppRunner(app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    answers: dict[str, bytes] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/whole", "/streamed", "/image"):
                async with session.post(f"http://127.0.0.1:{port}{path}") as resp:
                    assert resp.status == 200, await resp.text()
                    answers[path] = await resp.read()
    finally:
        await runner.cleanup()
    return answers


def test_the_answer_path_never_blocks_the_loop() -> None:
    with strict_loop():
        answers = uvloop.run(serve_and_ask())
    assert read_wav(answers["/whole"])[0].size == 4800
    streamed, rate = read_wav(answers["/streamed"])
    assert rate == 24000
    np.testing.assert_allclose(streamed, np.concatenate([wave(c) for c in range(3)]), atol=1e-4)
    png = base64.b64decode(json.loads(answers["/image"])["png"])
    np.testing.assert_array_equal(read_png(png), IMAGE_PIXELS)


def test_the_start_up_sweep_of_orphaned_shm_runs_off_the_loop(tmp_path: Path) -> None:
    orphan = tmp_path / "omni-999999999-dead-1"  # no such pid: an orphan
    orphan.write_bytes(b"x")
    with strict_loop():
        removed = uvloop.run(sweep_orphaned_shm(directory=str(tmp_path)))
    assert removed == 1 and not orphan.exists()


def test_the_guard_catches_a_blocking_call() -> None:
    """The check is live: our code encoding a WAV on the loop is refused."""

    async def encode_on_the_loop() -> FinalOutput:
        return final_output(TTS, 1, audio(0, more=False).outputs[1])

    with strict_loop(), pytest.raises(BlockingError, match="wav_bytes"):
        uvloop.run(encode_on_the_loop())
