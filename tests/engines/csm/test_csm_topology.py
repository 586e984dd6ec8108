"""csm-tts served 2:1 (two talker replicas, one code2wav; stage pods over shared memory,
``async_chunk`` on: the talker streams codes to code2wav) through the official ``openai`` SDK:
``audio.speech`` streams PCM whose every sample equals transformers' monolithic
``CsmForConditionalGeneration.generate(..., output_audio=True)`` for the same seed and speaker
within one step of rounding (the streamed decode differs from the whole one by ~1e-7), its first
audio before the answer ends; concurrent requests interleaved on the talkers each give their
own answer; a bad voice is a 400 naming the allowed ones; a kill -9 of a talker engine
mid-request is replayed on the other talker with the same samples."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.engines.csm.csm_reference import TALKER_FRAMES, expected_pcm
from tests.engines.qwen3_omni.omni_reference import wav_samples
from tests.sidecar.topology import Topology, answers_while_killing

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PIPELINE = "csm-tts"
TEXT = "a small robot says hello"
SAMPLES = TALKER_FRAMES * 1920  # tiny-csm speaks max_frames frames of 80 ms


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    log_dir = tmp_path_factory.mktemp("csm-tts")
    config = ["--deploy-config", str(bundled_deploy_path(PIPELINE))]
    top = Topology(PIPELINE, [2, 1], log_dir, extra_stage_args=config)
    try:
        top.start()
        for stage_id, count in enumerate(top.replicas):
            top.wait_discovered(stage_id, count, timeout=120)
        yield top
    finally:
        for sdk in _CLIENTS.values():
            sdk.close()
        _CLIENTS.clear()
        top.close()


_CLIENTS: dict[str, openai.OpenAI] = {}


def client(topo: Topology) -> openai.OpenAI:
    """One SDK client per topology (thread-safe), closed with it: no sockets left to the GC."""
    sdk = _CLIENTS.get(topo.api_url)
    if sdk is None:
        sdk = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
        _CLIENTS[topo.api_url] = sdk
    return sdk


def speech_pcm(topo: Topology, voice: str, seed: int) -> tuple[np.ndarray, float, float]:
    """(PCM16 samples, seconds to the first bytes, seconds to the end) of a streamed speech."""
    started = time.perf_counter()
    first = 0.0
    data = b""
    with client(topo).audio.speech.with_streaming_response.create(
        model=PIPELINE, input=TEXT, voice=voice, response_format="pcm", extra_body={"seed": seed}
    ) as resp:
        for piece in resp.iter_bytes():
            if not data:
                first = time.perf_counter() - started
            data += piece
    return np.frombuffer(data, np.int16), first, time.perf_counter() - started


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape == (SAMPLES,)
    assert int(np.abs(got.astype(np.int32) - want.astype(np.int32)).max()) <= 1


@pytest.mark.parametrize(("voice", "speaker"), [("default", 0), ("1", 1)])
def test_streamed_speech_equals_the_monolithic_model(
    topo: Topology, voice: str, speaker: int
) -> None:
    samples, first, total = speech_pcm(topo, voice, seed=7)
    assert_same_audio(samples, expected_pcm(TEXT, speaker, seed=7))
    assert first < total * 0.8, (first, total)  # audio before the whole answer


def test_wav_speech_equals_the_monolithic_model(topo: Topology) -> None:
    out = client(topo).audio.speech.create(
        model=PIPELINE, input=TEXT, voice="0", response_format="wav", extra_body={"seed": 9}
    )
    assert_same_audio(wav_samples(out.content), expected_pcm(TEXT, 0, seed=9))


def test_concurrent_speeches_each_equal_the_monolithic_model(topo: Topology) -> None:
    seeds = [21, 22, 23, 24]
    results: dict[int, np.ndarray | Exception] = {}

    def run(seed: int) -> None:
        try:
            results[seed] = speech_pcm(topo, "0", seed)[0]
        except Exception as exc:  # reported below
            results[seed] = exc

    threads = [threading.Thread(target=run, args=(seed,)) for seed in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    got: dict[int, np.ndarray] = {}
    for seed in seeds:
        result = results[seed]
        assert not isinstance(result, Exception), result
        assert_same_audio(result, expected_pcm(TEXT, 0, seed))
        got[seed] = result
    assert not np.array_equal(got[21], got[22])


def test_speed_time_stretches_the_streamed_speech(topo: Topology) -> None:
    """``speed`` (CSM has no rate input): the answer time-stretched as it streams, pitch kept
    (``sidecar/api/time_stretch.py``, where a stream cut anywhere gives the samples of the
    whole stretched at once); the same samples as WAV or raw PCM, 1/speed as long."""
    sdk = client(topo)
    body = {"seed": 5}
    whole = sdk.audio.speech.create(
        model=PIPELINE, input=TEXT, voice="0", response_format="wav", speed=1.5, extra_body=body
    )
    fast = wav_samples(whole.content)
    assert fast.shape == (round(SAMPLES / 1.5),)
    data = b""
    with sdk.audio.speech.with_streaming_response.create(
        model=PIPELINE, input=TEXT, voice="0", response_format="pcm", speed=1.5, extra_body=body
    ) as resp:
        for piece in resp.iter_bytes():
            data += piece
    assert np.array_equal(np.frombuffer(data, np.int16), fast)
    slow = wav_samples(
        sdk.audio.speech.create(
            model=PIPELINE, input=TEXT, voice="0", speed=0.5, extra_body=body
        ).content
    )
    assert slow.shape == (SAMPLES * 2,)


def test_a_bad_voice_is_a_400_naming_the_allowed_ones(topo: Topology) -> None:
    with pytest.raises(openai.BadRequestError, match=r"unknown voice 'alloy'; allowed: default"):
        client(topo).audio.speech.create(model=PIPELINE, input="hi", voice="alloy")


def test_kill_9_of_a_talker_engine_mid_request_is_replayed(topo: Topology) -> None:
    seeds = [31, 32, 33, 34]
    retries_before = topo.metric(topo.api_url, "omni_stage_hop_retries_total")
    # a talker, mid-request
    results = answers_while_killing(topo, 0, lambda seed: speech_pcm(topo, "1", seed)[0], seeds)
    for seed in seeds:
        got = results[seed]
        assert not isinstance(got, Exception), got
        assert_same_audio(got, expected_pcm(TEXT, 1, seed))
    assert topo.metric(topo.api_url, "omni_stage_hop_retries_total") > retries_before
