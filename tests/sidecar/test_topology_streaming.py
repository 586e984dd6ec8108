"""async_chunk as a client sees it, across real processes: speech streamed through the openai SDK
when asked (the PCM of the unary answer, both code2wav replicas decoding chunks), a WAV not asked
to stream saved whole with its true lengths, the API server's audio SLOs of streamed answers
(speech and chat, by pipeline, route and tenant), SSE speech, the omni-run
loop joining a streamed stage's chunks into the same bytes, chat completions streamed with audio,
the first streamed bytes long before the whole answer, and a talker killed mid-stream replayed
into the identical audio."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import signal
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

import omni_mesh
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import Prompt
from omni_mesh.run_client.client import FixedUrls, RunClient
from tests.procs import wait_until
from tests.sidecar.topology import Topology, post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DEPLOY = Path(omni_mesh.__file__).parent / "configs" / "deploy"
TEXT = "Streaming speech, one chunk at a time."  # 38 bytes: 76 frames, 19 chunks of 4
SEED = 7


def chunked_config(tmp: Path, pipeline: str, stages: str) -> list[str]:
    """``--deploy-config`` of an overlay of the bundled config with async_chunk on."""
    path = tmp / f"{pipeline}-async-chunk.yaml"
    path.write_text(f"base_config: {DEPLOY / pipeline}.yaml\nasync_chunk: true\nstages:\n{stages}")
    return ["--deploy-config", str(path)]


TALKER_CHUNKS = "    engine_extras: {chunk_frames: 4}\n"


@pytest.fixture(scope="module")
def tts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    before = shm_segments()
    tmp = tmp_path_factory.mktemp("tts")
    extra = chunked_config(tmp, "tiny-tts", "  - stage_id: 0\n" + TALKER_CHUNKS)
    topo = Topology("tiny-tts", [2, 2], tmp, extra_stage_args=extra).start()
    try:
        topo.wait_discovered(0, 2)
        topo.wait_discovered(1, 2)
        yield topo
    finally:
        _close_clients()
        topo.close()
    wait_until(lambda: not (shm_segments() - before), 5.0, message=lambda: "shm leaked")


_CLIENTS: dict[str, openai.OpenAI] = {}


def _client(topo: Topology) -> openai.OpenAI:
    """One SDK client per topology, closed with it (a client left to the garbage collector
    leaves an unclosed socket: a ResourceWarning, an error in this suite)."""
    sdk = _CLIENTS.get(topo.api_url)
    if sdk is None:
        sdk = openai.OpenAI(base_url=topo.api_url + "/v1", api_key="unused", max_retries=0)
        _CLIENTS[topo.api_url] = sdk
    return sdk


def _close_clients() -> None:
    for sdk in _CLIENTS.values():
        sdk.close()
    _CLIENTS.clear()


def generated(topo: Topology, body: dict[str, object]) -> dict[str, dict[str, str]]:
    status, raw = post_json(topo.api_url + "/v1/generate", body)
    assert status == 200, raw
    outputs: dict[str, dict[str, str]] = json.loads(raw)["outputs"]
    return outputs


def generated_wav(topo: Topology, text: str, seed: int, voice: str) -> bytes:
    outputs = generated(topo, {"prompt": text, "seed": seed, "voice": voice})
    audio = next(o for o in outputs.values() if o["kind"] == "audio")
    return base64.b64decode(audio["data"])


def test_speech_streams_through_the_sdk_with_the_unary_pcm(tts: Topology) -> None:
    reference = generated_wav(tts, TEXT, SEED, "alloy")
    pcm, rate = media.wav_pcm(reference)
    assert rate == 24000 and len(pcm) > 0
    client = _client(tts)
    with client.audio.speech.with_streaming_response.create(
        model="tiny-tts",
        input=TEXT,
        voice="alloy",
        response_format="wav",
        extra_body={"seed": SEED, "stream": True},  # a WAV streams when asked to
    ) as resp:
        assert resp.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in resp.headers
        pieces = list(resp.iter_bytes())
    body = b"".join(pieces)
    assert len(pieces) >= 2, "the audio arrived in one piece"
    assert body[:44] == media.wav_stream_header(24000)
    assert body[44:] == pcm  # the same samples as the unary answer
    with client.audio.speech.with_streaming_response.create(
        model="tiny-tts",
        input=TEXT,
        voice="alloy",
        response_format="pcm",
        extra_body={"seed": SEED},
        extra_headers={"X-Omni-Tenant": "acme"},
    ) as resp:
        assert resp.read() == pcm
    # Every code2wav replica decoded chunks.
    for url in tts.urls[1]:
        assert tts.metric(url, "omni_stage_requests_total", route="hop", outcome="ok") > 0, url
    # The API server recorded when each streamed answer's first bytes went out.
    first = "omni_api_first_chunk_seconds_count"
    assert tts.metric(tts.api_url, first, route="/v1/audio/speech") >= 2
    # ... and the audio SLOs of each, by pipeline, route and tenant (the header's).
    labels = {"pipeline": "tiny-tts", "route": "/v1/audio/speech", "tenant": "acme"}
    assert tts.metric(tts.api_url, "omni_api_audio_first_seconds_count", **labels) == 1
    audio_s = tts.metric(tts.api_url, "omni_api_audio_seconds_total", **labels)
    assert audio_s == pytest.approx(len(pcm) / 2 / 24000)
    assert tts.metric(tts.api_url, "omni_api_audio_realtime_factor_count", **labels) == 1
    assert tts.metric(tts.api_url, "omni_api_audio_realtime_factor_sum", **labels) > 0
    # The streamed WAV's tenant: the SDK's API key's hash (no header).
    streams = tts.metric(tts.api_url, "omni_api_audio_first_seconds_count", route=labels["route"])
    assert streams >= 2


def test_a_wav_not_asked_to_stream_comes_whole_with_its_true_lengths(
    tts: Topology, tmp_path: Path
) -> None:
    # As a new user saves one: a streamed WAV's header says 0xFFFFFFFF data bytes (24.8 hours
    # to Python's wave module); one the client did not ask to stream is whole, its lengths true.
    pcm, _ = media.wav_pcm(generated_wav(tts, TEXT, SEED, "alloy"))
    client = _client(tts)
    saved = tmp_path / "a.wav"
    client.audio.speech.create(
        model="tiny-tts", input=TEXT, voice="alloy", extra_body={"seed": SEED}
    ).write_to_file(saved)
    with wave.open(str(saved)) as wav:
        assert wav.getframerate() == 24000 and wav.getnchannels() == 1
        assert wav.getnframes() == len(pcm) // 2
        assert wav.readframes(wav.getnframes()) == pcm
    with client.audio.speech.with_streaming_response.create(
        model="tiny-tts", input=TEXT, voice="alloy", extra_body={"seed": SEED, "stream": False}
    ) as resp:
        assert int(resp.headers["content-length"]) == saved.stat().st_size
        assert resp.read() == saved.read_bytes()


def test_usage_per_stage_adds_up_to_the_engines_busy_time(tts: Topology) -> None:
    """Each answer's ``usage.omni`` gives every stage's engine seconds attributed to it (each
    engine step's time shared among the requests it advanced); over concurrent requests their
    sum is each stage's own stepping time (its pods' omni_stage_engine_busy_seconds_total)
    within 5%, and the API server counts the same per tenant and stage."""

    def busy(stage: int) -> float:
        return sum(tts.metric(u, "omni_stage_engine_busy_seconds_total") for u in tts.urls[stage])

    def counted(stage: int) -> float:
        return tts.metric(
            tts.api_url, "omni_usage_engine_seconds_total", tenant="billing", stage=str(stage)
        )

    time.sleep(1.2)  # every engine's stats report of earlier traffic is in
    before = {stage: busy(stage) for stage in (0, 1)}
    counted_before = {stage: counted(stage) for stage in (0, 1)}
    usages: list[dict[str, float]] = []
    audio: list[float] = []

    def one(i: int) -> None:
        body = {"prompt": f"{TEXT} {i}", "seed": i, "voice": "alloy"}
        headers = {"X-Omni-Tenant": "billing"}
        status, raw = post_json(tts.api_url + "/v1/generate", body, headers=headers)
        assert status == 200, raw
        omni = json.loads(raw)["usage"]["omni"]
        usages.append(omni["engine_seconds"])
        audio.append(omni["audio_out_seconds"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(usages) == 8 and all(a > 0 for a in audio)
    used = {stage: sum(u.get(str(stage), 0.0) for u in usages) for stage in (0, 1)}
    for stage in (0, 1):
        assert used[stage] > 0, usages

        def settled(stage: int = stage) -> bool:
            return busy(stage) - before[stage] >= used[stage] * 0.95

        wait_until(settled, 10, interval=0.3, message=lambda: f"{used}, {before}")
        time.sleep(1.2)  # the last stats report is in
        grown = busy(stage) - before[stage]
        assert abs(used[stage] - grown) <= 0.05 * grown, (stage, used[stage], grown)
        billed = counted(stage) - counted_before[stage]
        assert billed == pytest.approx(used[stage], rel=1e-3, abs=1e-5)


def test_a_sessions_requests_keep_to_one_replica_of_each_stage(tts: Topology) -> None:
    """Session affinity (``X-Omni-Session``): every hop of one session goes to the same talker
    and the same code2wav replica (the API server counts them ``home``); other sessions spread
    over both."""

    def hops(url: str) -> float:
        return tts.metric(url, "omni_stage_requests_total", route="hop", outcome="ok")

    def generate(session: str, i: int) -> None:
        body = {"prompt": f"hello {i}", "seed": i, "voice": "alloy"}
        status, raw = post_json(
            tts.api_url + "/v1/generate", body, headers={"X-Omni-Session": session}
        )
        assert status == 200, raw

    home = 'omni_stage_affinity_picks_total{from_stage="-1",outcome="home"'
    picks = tts.metric(tts.api_url, home)
    before = {url: hops(url) for stage in (0, 1) for url in tts.urls[stage]}
    for i in range(6):
        generate("alice", i)
    grown = {url: hops(url) - before[url] for url in before}
    talkers = sorted(grown[url] for url in tts.urls[0])
    decoders = sorted(grown[url] for url in tts.urls[1])  # a hop per talker chunk
    assert talkers == [0.0, 6.0] and decoders[0] == 0.0 and decoders[1] >= 6.0, grown
    assert tts.metric(tts.api_url, home) == picks + 6  # the API server's hops to the talker
    before = {url: hops(url) for url in before}
    for i in range(12):
        generate(f"user-{i}", i)
    assert all(hops(url) > before[url] for url in tts.urls[0])  # 12 sessions use both


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/generate?stream=maybe", {"prompt": "x"}, "stream"),
        ("/v1/generate?stream=true&stream=false", {"prompt": "x"}, "stream"),
        (
            "/v1/chat/completions",
            {
                "model": "tiny-tts",
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            },
            "stream_options",
        ),
        (
            "/v1/audio/speech",
            {"model": "tiny-tts", "input": "x", "stream_format": "chunks"},
            "stream_format",
        ),
        ("/v1/audio/speech", {"model": "tiny-tts", "input": "x", "stream": "yes"}, "stream"),
    ],
)
def test_bad_streaming_options_are_a_400_naming_them(
    tts: Topology, path: str, body: dict[str, object], needle: str
) -> None:
    status, raw = post_json(tts.api_url + path, body)
    assert status == 400, raw
    assert needle in json.loads(raw)["error"]["message"]


def test_sse_speech_carries_the_same_pcm(tts: Topology) -> None:
    reference, _ = media.wav_pcm(generated_wav(tts, TEXT, SEED, "alloy"))
    client = _client(tts)
    with client.audio.speech.with_streaming_response.create(
        model="tiny-tts", input=TEXT, voice="alloy", stream_format="sse", extra_body={"seed": SEED}
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == reference
    # The done event's usage says what each stage's engines spent on it, and the audio out.
    omni = events[-1]["usage"]["omni"]
    assert set(omni["engine_seconds"]) == {"0", "1"} and min(omni["engine_seconds"].values()) > 0
    assert omni["audio_out_seconds"] == pytest.approx(len(reference) / 2 / 24000, abs=1e-4)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_omni_run_joins_the_chunks_into_the_same_bytes(tts: Topology, binary: bool) -> None:
    reference = generated_wav(tts, TEXT, SEED, "echo")

    async def loop() -> tuple[bytes, list[int]]:
        pipeline = get_pipeline("tiny-tts")
        async with RunClient(pipeline, FixedUrls([tts.api_url]), msgpack=binary) as rc:
            trace = await rc.run(Prompt(prompt=TEXT, seed=SEED, voice="echo"))
        chunks = sorted(c.chunk for c in trace.calls if c.stage_id == 1)
        return trace.outputs[1].data or b"", chunks

    audio, chunks = asyncio.run(loop())
    assert chunks == list(range(len(chunks))) and len(chunks) > 2  # one call per chunk
    assert audio == reference


def test_a_talker_killed_mid_stream_is_replayed_into_the_same_audio(tts: Topology) -> None:
    """Last in this module: it leaves one talker."""
    long_text = "A longer sentence for the talker to speak, so that it streams a while. " * 2
    reference = generated_wav(tts, long_text, 3, "onyx")
    got: dict[str, bytes] = {}

    def client() -> None:
        got["audio"] = generated_wav(tts, long_text, 3, "onyx")

    chunks = "omni_stage_output_chunks_total"
    before = [tts.metric(url, chunks) for url in tts.urls[0]]

    def streaming() -> int | None:
        """The talker replica that is part-way through the request's chunks."""
        for i, url in enumerate(tts.urls[0]):
            in_flight = tts.metric(url, "omni_stage_in_flight")
            if in_flight >= 1 and tts.metric(url, chunks) - before[i] >= 2:
                return i
        return None

    thread = threading.Thread(target=client)
    thread.start()
    victim: list[int] = []

    def found() -> bool:
        i = streaming()
        if i is not None:
            victim.append(i)
        return i is not None

    wait_until(found, 10.0)
    os.kill(tts.stages[0][victim[0]].pid, signal.SIGKILL)
    thread.join(timeout=120)
    assert got["audio"] == reference  # no chunk lost, none twice
    assert tts.metric(tts.api_url, "omni_stage_hop_retries_total", to_stage="0") >= 1


# ---- chat on tiny-omni -----------------------------------------------------------------------


def test_chat_streams_text_then_audio_through_the_sdk(tmp_path: Path) -> None:
    extra = chunked_config(tmp_path, "tiny-omni", "  - stage_id: 1\n" + TALKER_CHUNKS)
    topo = Topology("tiny-omni", [1, 1, 1], tmp_path, extra_stage_args=extra).start()
    try:
        topo.wait_discovered(2, 1)
        prompt = "Say something."
        outputs = generated(topo, {"prompt": prompt, "seed": 11, "voice": "nova"})
        pcm, _ = media.wav_pcm(base64.b64decode(outputs["2"]["data"]))
        stream = _client(topo).chat.completions.create(
            model="tiny-omni",
            messages=[{"role": "user", "content": prompt}],
            modalities=["text", "audio"],
            audio={"voice": "nova", "format": "pcm16"},
            seed=11,
            stream=True,
        )
        chunks = list(stream)
        first = chunks[0].choices[0].delta
        assert first.role == "assistant" and first.content == outputs["0"]["text"]
        audio = [c.choices[0].delta.audio for c in chunks if c.choices[0].delta.audio]
        assert len(audio) >= 2  # the audio came in several deltas
        assert b"".join(base64.b64decode(a.data or "") for a in audio) == pcm
        assert chunks[-1].choices[0].finish_reason == "stop"
        labels = {"pipeline": "tiny-omni", "route": "/v1/chat/completions"}
        audio_s = topo.metric(topo.api_url, "omni_api_audio_seconds_total", **labels)
        assert audio_s == pytest.approx(len(pcm) / 2 / 24000)
        assert topo.metric(topo.api_url, "omni_api_audio_first_seconds_count", **labels) == 1
    finally:
        _close_clients()
        topo.close()


# ---- time to the first bytes -----------------------------------------------------------------


def test_the_first_chunk_arrives_long_before_the_whole_answer(tmp_path: Path) -> None:
    stages = "  - stage_id: 0\n    output_chunks: 4\n    step_latency_ms: 300\n"
    extra = chunked_config(tmp_path, "synthetic", stages)
    topo = Topology("synthetic", [1, 1, 1], tmp_path, extra_stage_args=extra).start()
    try:
        topo.wait_discovered(2, 1)
        whole = base64.b64decode(generated(topo, {"prompt": "p", "seed": 5})["2"]["data"])
        parts = urlsplit(topo.api_url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
        t0 = time.monotonic()
        conn.request(
            "POST",
            "/v1/generate?stream=true",
            body=json.dumps({"prompt": "p", "seed": 5}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        arrivals: list[tuple[float, dict[str, object]]] = []
        for line in resp:
            if line.startswith(b"data: "):
                arrivals.append((time.monotonic() - t0, json.loads(line[6:])))
        conn.close()
        total = arrivals[-1][0]
        assert arrivals[-1][1]["type"] == "done"
        chunk_events = [e for _, e in arrivals if e["type"] == "output.chunk"]
        assert [e["chunk"] for e in chunk_events] == [0, 1, 2, 3]
        first = arrivals[0][0]
        assert first < 0.6 * total, (first, total)
        data = b"".join(base64.b64decode(e["output"]["data"]) for e in chunk_events)  # type: ignore[index]
        assert data == whole
    finally:
        topo.close()
