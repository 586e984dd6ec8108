"""qwen3-omni served 1:2:1 (stage pods over shared memory, ``async_chunk`` on: the thinker hands
its answer to the talker in chunks as it makes it, the talker streams codes to code2wav) through
the official ``openai`` SDK: chat with text and audio out (and audio in) equals transformers'
monolithic ``generate`` for the same seed (the text exactly, every PCM16 sample within one step
of rounding: the streamed decode differs from the whole one by ~1e-14); speech streams its first
audio before the answer ends; a kill -9 of a talker engine mid-request is replayed on the other
talker (which pulls the thinker's chunks again) with the same bytes."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest

from tests.engines.qwen3_omni.omni_reference import (
    assert_same_audio,
    audio_messages,
    expected,
    sdk_chat,
    wav_samples,
)
from tests.procs import wait_until
from tests.sidecar.topology import Topology, answers_while_killing

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

PIPELINE = "qwen3-omni"
TEXT = [{"role": "user", "content": "tell me a story about a small robot"}]


@pytest.fixture(scope="module")
def topo(qwen3_omni_topology: Topology) -> Iterator[Topology]:
    try:
        yield qwen3_omni_topology
    finally:
        for sdk in _CLIENTS.values():
            sdk.close()
        _CLIENTS.clear()


_CLIENTS: dict[str, openai.OpenAI] = {}


def client(topo: Topology) -> openai.OpenAI:
    """One SDK client per topology (thread-safe), closed with it: no sockets left to the GC."""
    sdk = _CLIENTS.get(topo.api_url)
    if sdk is None:
        sdk = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
        _CLIENTS[topo.api_url] = sdk
    return sdk


def chat(topo: Topology, messages: list[dict[str, Any]], seed: int, max_tokens: int = 8) -> Any:
    return sdk_chat(client(topo), messages, seed, max_tokens)


@pytest.mark.parametrize("audio_in", [False, True], ids=["text-in", "audio-in"])
def test_chat_equals_the_monolithic_model(topo: Topology, audio_in: bool) -> None:
    messages = audio_messages() if audio_in else TEXT
    before = fed_chunks(topo)
    text, samples = chat(topo, messages, seed=7)
    want_text, want_samples = expected(messages, seed=7, max_tokens=8)
    assert text == want_text
    assert_same_audio(samples, want_samples)
    assert len(samples) > 1920 * 60  # 63 frames of 80 ms
    # the thinker handed its answer on in chunks while it ran (the talker's stream_input)
    assert fed_chunks(topo) >= before + 3


def test_chat_usage_says_what_each_stage_and_the_audio_used(topo: Topology) -> None:
    """OpenAI's usage (the thinker's tokens) and omni-mesh's ``usage.omni``: each stage's
    engine seconds attributed to the request, the seconds of audio in (the 1 s tone) and out."""
    out = client(topo).chat.completions.create(
        model=PIPELINE,
        messages=audio_messages(),
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        seed=7,
        max_tokens=8,
    )
    usage = out.usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens == 8
    omni = (usage.model_extra or {})["omni"]
    assert set(omni["engine_seconds"]) == {"0", "1", "2"}, omni
    assert all(seconds > 0 for seconds in omni["engine_seconds"].values()), omni
    assert omni["audio_in_seconds"] == pytest.approx(1.0, abs=1e-3)
    assert out.choices[0].message.audio is not None
    samples = wav_samples(base64.b64decode(out.choices[0].message.audio.data))
    assert omni["audio_out_seconds"] == pytest.approx(len(samples) / 24000, abs=1e-3)


def fed_chunks(topo: Topology) -> float:
    """Later chunks of streamed inputs the talkers pulled and fed to their engines."""
    return sum(topo.metric(url, "omni_stage_input_chunks_total") for url in topo.urls[1])


def test_a_text_only_chat_runs_the_thinker_alone(topo: Topology) -> None:
    hops = [topo.metric(url, "omni_stage_requests_total", route="hop") for url in topo.urls[1]]
    out = client(topo).chat.completions.create(
        model=PIPELINE,
        messages=TEXT,  # type: ignore[arg-type]
        seed=7,
        max_tokens=8,
    )
    assert out.choices[0].message.content == expected(TEXT, seed=7, max_tokens=8)[0]
    assert out.choices[0].message.audio is None
    assert out.usage is not None and out.usage.completion_tokens == 8
    after = [topo.metric(url, "omni_stage_requests_total", route="hop") for url in topo.urls[1]]
    assert after == hops  # no talker ran


def test_streamed_chat_sends_text_token_by_token_then_audio(topo: Topology) -> None:
    text, samples = chat(topo, TEXT, seed=9)
    events = list(
        client(topo).chat.completions.create(
            model=PIPELINE,
            messages=TEXT,  # type: ignore[arg-type]
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "pcm16"},
            seed=9,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    kinds: list[str] = []
    texts: list[str] = []
    pcm = b""
    for event in events:
        for choice in event.choices:
            audio = choice.delta.audio
            if audio is not None and audio.data:
                kinds.append("audio")
                pcm += base64.b64decode(audio.data)
            elif choice.delta.content:
                kinds.append("text")
                texts.append(choice.delta.content)
    assert "".join(texts) == text
    assert kinds.count("text") > 3  # token by token (a tiny vocabulary: a few bytes each)
    assert kinds.index("audio") > kinds.index("text")
    assert kinds.count("audio") > 3  # every decoded chunk
    assert_same_audio(np.frombuffer(pcm, np.int16), samples)
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 8


def test_speech_streams_before_the_answer_ends(topo: Topology) -> None:
    started = time.perf_counter()
    firsts: list[float] = []
    data = b""
    with client(topo).audio.speech.with_streaming_response.create(
        model=PIPELINE, input="say something", voice="ethan", response_format="pcm"
    ) as resp:
        for piece in resp.iter_bytes():
            firsts.append(time.perf_counter() - started)
            data += piece
    total = time.perf_counter() - started
    assert len(data) > 1920 * 2 * 60
    assert firsts[0] < total * 0.8, (firsts[0], total)  # audio before the whole answer

    # The talkers report how their steps keep up with playback (80 ms of audio per stream and
    # step over the step's time); a talker that ran the speech has stepped.
    def factor() -> float:
        return max(topo.metric(url, "omni_stage_stream_realtime_factor") for url in topo.urls[1])

    wait_until(lambda: factor() > 0, 10, message=lambda: "no talker reported its factor")
    with pytest.raises(openai.BadRequestError, match="unknown voice 'alloy'"):
        client(topo).audio.speech.create(model=PIPELINE, input="hi", voice="alloy")


def test_kill_9_of_a_talker_engine_mid_request_is_replayed(topo: Topology) -> None:
    seeds = [31, 32, 33, 34]
    want = {seed: expected(TEXT, seed, max_tokens=8) for seed in seeds}
    (thinker_url,) = topo.urls[0]
    retries_before = topo.metric(thinker_url, "omni_stage_hop_retries_total")
    # a talker, mid-request
    results = answers_while_killing(topo, 1, lambda seed: chat(topo, TEXT, seed), seeds)
    for seed in seeds:
        got = results[seed]
        assert not isinstance(got, Exception), got
        assert got[0] == want[seed][0]
        assert_same_audio(got[1], want[seed][1])
    assert topo.metric(thinker_url, "omni_stage_hop_retries_total") > retries_before
