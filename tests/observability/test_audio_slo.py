"""Audio SLOs of streamed answers (``observability/audio_slo.py``): a listener's playback of
the audio as it is sent (time to first audio, real-time factor, underruns with the playback
clock moving by each gap), the series recorded per pipeline, route and tenant (tenant labels
bounded), and over real HTTP: a speech stream whose chunks come slower than they play underruns
once per late chunk, one that comes faster never does, and the figures land in the request's
span attributes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import HopResult
from omni_mesh.data_plane.tensors import payload_from_arrays
from omni_mesh.launcher.supervisor import free_port
from omni_mesh.observability.audio_slo import AudioPlayback, AudioSloMetrics
from omni_mesh.observability.tenant_labels import MAX_TENANT_LABELS
from omni_mesh.sidecar.api.playback import Playbacks
from omni_mesh.sidecar.api.sinks import SpeechAudio, SpeechEvents, respond
from omni_mesh.sidecar.middleware import error_middleware
from tests.sidecar.scripted import Item, Script

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TTS = get_pipeline("tiny-tts")  # stage 1: audio
RATE = 24000
CHUNK = 960  # 40 ms at 24 kHz
ROUTE = "/v1/audio/speech"


def sample(metrics: AudioSloMetrics, registry: CollectorRegistry, name: str, tenant: str) -> float:
    labels = {"pipeline": "tiny-tts", "route": ROUTE, "tenant": tenant}
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# ---- the playback model ------------------------------------------------------------------------


def test_a_stream_faster_than_playback_never_underruns() -> None:
    playback = AudioPlayback(started=10.0)
    for i in range(5):  # 1 s of audio every 0.5 s
        playback.sent(1.0, 10.2 + 0.5 * i)
    assert playback.first_audio_s == pytest.approx(0.2)
    assert playback.underruns == 0 and playback.gap_s == 0.0
    assert playback.realtime_factor == pytest.approx(5.0 / 2.2)


def test_a_late_chunk_is_one_underrun_and_moves_the_playback_clock() -> None:
    playback = AudioPlayback(started=0.0)
    playback.sent(1.0, 1.0)  # plays 1.0 .. 2.0
    playback.sent(1.0, 1.5)  # in time: plays 2.0 .. 3.0
    playback.sent(1.0, 3.5)  # 0.5 s late: silence 3.0 .. 3.5, plays 3.5 .. 4.5
    playback.sent(1.0, 4.0)  # in time on the moved clock (not late against 3.0 + 1.0)
    playback.sent(0.5, 6.0)  # 1.5 s late: runs out at 5.5
    assert playback.underruns == 2
    assert playback.gap_s == pytest.approx(0.5 + 0.5)
    assert playback.realtime_factor == pytest.approx(4.5 / 6.0)
    attributes = playback.attributes()
    assert attributes["omni.audio.underruns"] == 2
    assert attributes["omni.audio.first_s"] == pytest.approx(1.0)


def test_nothing_is_recorded_without_audio_and_a_stream_is_recorded_once() -> None:
    registry = CollectorRegistry()
    metrics = AudioSloMetrics(registry)
    silent = AudioPlayback(started=0.0)
    metrics.record(silent, "tiny-tts", ROUTE, "")
    assert silent.attributes() == {}
    assert sample(metrics, registry, "omni_api_audio_first_seconds_count", "anonymous") == 0
    playback = AudioPlayback(started=0.0)
    playback.sent(2.0, 0.25)
    playback.sent(2.0, 3.0)  # 0.75 s late
    metrics.record(playback, "tiny-tts", ROUTE, "")
    metrics.record(playback, "tiny-tts", ROUTE, "")
    assert sample(metrics, registry, "omni_api_audio_first_seconds_count", "anonymous") == 1
    assert sample(metrics, registry, "omni_api_audio_first_seconds_sum", "anonymous") == 0.25
    assert sample(metrics, registry, "omni_api_audio_seconds_total", "anonymous") == 4.0
    assert sample(metrics, registry, "omni_api_audio_underruns_total", "anonymous") == 1
    gap = sample(metrics, registry, "omni_api_audio_underrun_seconds_total", "anonymous")
    assert gap == pytest.approx(0.75)
    rtf = sample(metrics, registry, "omni_api_audio_realtime_factor_sum", "anonymous")
    assert rtf == pytest.approx(4.0 / 3.0)


def test_tenant_labels_are_bounded() -> None:
    metrics = AudioSloMetrics(CollectorRegistry())
    names = [metrics.tenant_label(f"t{i}") for i in range(MAX_TENANT_LABELS + 5)]
    assert names[:MAX_TENANT_LABELS] == [f"t{i}" for i in range(MAX_TENANT_LABELS)]
    assert set(names[MAX_TENANT_LABELS:]) == {"other"}
    assert metrics.tenant_label("t3") == "t3"  # one seen before keeps its name
    assert metrics.tenant_label("") == "other"  # anonymous came after the bound here


# ---- over real HTTP ----------------------------------------------------------------------------


def audio_frame(chunk: int) -> HopResult:
    wave = np.zeros(CHUNK, np.float32) + 0.01 * chunk
    payload = payload_from_arrays({"sample_rate": RATE}, {"waveform": wave})
    return HopResult(request_id="r", outputs={1: payload}, chunks={1: chunk}, more=True)


def streamed(n: int) -> list[Item]:
    return [*(audio_frame(c) for c in range(n)), HopResult(request_id="r")]


Metered = tuple[str, AudioSloMetrics, CollectorRegistry, list[Playbacks]]


@pytest.fixture
async def metered() -> AsyncIterator[Metered]:
    """A real server answering every POST from a script (``?delay=`` between frames, ``?sse``
    for SSE) through a speech sink fed by a Playbacks; its URL, the metrics, the playbacks."""
    registry = CollectorRegistry()
    metrics = AudioSloMetrics(registry)
    seen: list[Playbacks] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        delay = float(request.query.get("delay", "0"))
        playbacks = Playbacks(time.monotonic(), ROUTE, request.headers.get("X-Omni-Tenant", ""))
        seen.append(playbacks)
        sink = (
            SpeechEvents(1, playbacks=playbacks)
            if "sse" in request.query
            else SpeechAudio(1, "pcm", playbacks=playbacks)
        )
        try:
            return await respond(request, TTS, Script(streamed(5), delay_s=delay).frames(), sink)
        finally:
            playbacks.record(metrics, "tiny-tts")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/", handle)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    yield str(server.make_url("/")), metrics, registry, seen
    await server.close()


async def post(url: str, tenant: str) -> bytes:
    headers = {"X-Omni-Tenant": tenant}
    async with aiohttp.ClientSession() as session, session.post(url, headers=headers) as resp:
        assert resp.status == 200
        return await resp.read()


@pytest.mark.parametrize("sse", [False, True], ids=["pcm", "sse"])
async def test_chunks_slower_than_playback_underrun_once_each(metered: Metered, sse: bool) -> None:
    url, metrics, registry, seen = metered
    query = "&sse=1" if sse else ""
    await post(f"{url}?delay=0.12{query}", "slow")  # 40 ms of audio every 120 ms
    playback = seen[-1].of()
    assert playback.audio_s == pytest.approx(5 * CHUNK / RATE)
    assert playback.underruns == 4  # every chunk after the first came late
    assert 4 * 0.06 < playback.gap_s < 4 * 0.3
    assert playback.realtime_factor is not None and playback.realtime_factor < 0.5
    assert sample(metrics, registry, "omni_api_audio_underruns_total", "slow") == 4
    assert sample(metrics, registry, "omni_api_audio_first_seconds_count", "slow") == 1


async def test_chunks_faster_than_playback_never_underrun(
    metered: Metered,
) -> None:
    url, metrics, registry, seen = metered
    body = await post(f"{url}?delay=0.002", "fast")  # 40 ms of audio every 2 ms
    assert len(body) == 5 * CHUNK * 2
    assert seen[-1].of().underruns == 0
    assert sample(metrics, registry, "omni_api_audio_underruns_total", "fast") == 0
    assert sample(metrics, registry, "omni_api_audio_seconds_total", "fast") == pytest.approx(0.2)
