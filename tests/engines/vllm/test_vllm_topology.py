"""``tiny-omni-vllm`` as real processes, streaming (``async_chunk: true``): omni-cp, an API server,
a vLLM thinker pod, two vLLM talker pods (headless) and a code2wav pod. The thinker streams its
tokens one by one (its bundled chunk_tokens 1), each spoken by a talker and decoded by code2wav
as it comes. ``/v1/generate`` gives the thinker's text and the audio, deterministic per seed;
``/v1/audio/speech`` answers a WAV, also through the official ``openai`` SDK, streamed; a chat
with audio through the SDK streams text deltas, then audio deltas; bad sampling values are a 400
naming the field; and kill -9 of a talker's vLLM engine process mid-generation under load costs
no request: its hops are replayed on the other talker with the same answer. (Whole answers,
async_chunk off, are tested at the engine: test_vllm_engine_process.py.)"""

from __future__ import annotations

import base64
import json
import re
import signal
import time
from collections.abc import Iterator

import openai
import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.procs import wait_until
from tests.sidecar.realtime.sdk import until
from tests.sidecar.topology import (
    Topology,
    answers_while_killing,
    held_engines,
    post_json,
    run_in_slices,
)

# 600 s: the first test's timeout also covers the module's start-up (three vLLM engines on the
# 2 cores, which on a loaded machine took more than 180 s to be all discovered).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

DISCOVERY_S = 420.0  # every pod of the topology discovered, all together

PIPELINE = "tiny-omni-vllm"


@pytest.fixture(scope="module")
def topo(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    log_dir = tmp_path_factory.mktemp("vllm-topology")
    overlay = log_dir / "streaming.yaml"
    overlay.write_text(f"base_config: {bundled_deploy_path(PIPELINE)}\nasync_chunk: true\n")
    top = Topology(PIPELINE, [1, 2, 1], log_dir, extra_stage_args=["--deploy-config", str(overlay)])
    try:  # free_port() picks below the ephemeral range: vLLM's own sockets cannot take them
        top.start()
        deadline = time.monotonic() + DISCOVERY_S
        for stage_id, count in enumerate(top.replicas):
            top.wait_discovered(stage_id, count, timeout=max(1.0, deadline - time.monotonic()))
        yield top
    finally:
        # SIGTERM to every pod at once (each drains and stops its vLLM engine in seconds; one by
        # one that added up to a minute), then the ordered close reaps them.
        for proc in [p for ps in top.stages.values() for p in ps] + [top.api]:
            if proc is not None and proc.alive:
                proc.send_signal(signal.SIGTERM)
        top.close()


def generate(topo: Topology, seed: int, max_tokens: int = 24) -> tuple[str, bytes]:
    status, body = post_json(
        f"{topo.api_url}/v1/generate",
        {"prompt": f"tell me a story number {seed}", "seed": seed, "max_tokens": max_tokens},
        timeout=120,
    )
    assert status == 200, body[:500]
    outputs = json.loads(body)["outputs"]
    return outputs["0"]["text"], base64.b64decode(outputs["2"]["data"])


def test_generate_gives_text_and_audio_deterministic_per_seed(topo: Topology) -> None:
    text, audio = generate(topo, seed=5)
    assert text and audio[:4] == b"RIFF"
    # 24 thinker tokens -> 2 frames each -> 48 frames of 1920 samples (int16) after the header
    assert len(audio) >= 48 * 1920 * 2
    assert generate(topo, seed=5) == (text, audio)
    assert generate(topo, seed=6)[1] != audio


def test_speech_route(topo: Topology) -> None:
    status, body = post_json(
        f"{topo.api_url}/v1/audio/speech",
        {"model": PIPELINE, "input": "hello there", "voice": "echo", "seed": 3},
        timeout=120,
    )
    assert status == 200, body[:500]
    assert body[:4] == b"RIFF" and len(body) > 44


def test_sdk_speech_streams_a_wav(topo: Topology) -> None:
    client = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
    pieces: list[bytes] = []
    with client.audio.speech.with_streaming_response.create(
        model=PIPELINE, voice="echo", input="hello there", extra_body={"seed": 3, "stream": True}
    ) as response:
        assert response.headers.get("content-length") is None  # streamed, chunked
        pieces.extend(response.iter_bytes())
    body = b"".join(pieces)
    assert body[:4] == b"RIFF" and len(body) > 44


def test_sdk_chat_with_audio_streams_text_then_audio(topo: Topology) -> None:
    client = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
    events = list(
        client.chat.completions.create(
            model=PIPELINE,
            messages=[{"role": "user", "content": "tell me a story"}],
            modalities=["text", "audio"],
            audio={"voice": "echo", "format": "pcm16"},
            max_tokens=24,
            seed=7,
            stream=True,
        )
    )
    kinds = []
    for event in events:
        if not event.choices:
            continue
        delta = event.choices[0].delta
        audio = getattr(delta, "audio", None)  # the SDK types it (ChoiceDeltaAudio)
        if delta.content:
            kinds.append("text")
        if audio is not None:
            kinds.append("audio")
            assert base64.b64decode(audio.data)
    # The thinker's text streams token by token (chunk_tokens 1; a token that is no whole
    # character yet comes with the next) and the audio follows as each token is spoken.
    assert kinds.count("text") >= 12 and kinds.count("audio") >= 12, kinds
    assert kinds.index("text") < kinds.index("audio")
    assert events[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("sampling", "field"),
    [({"top_p": 2.0}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty")],
)
def test_bad_sampling_is_a_400_naming_the_field(
    topo: Topology, sampling: dict[str, float], field: str
) -> None:
    status, body = post_json(
        f"{topo.api_url}/v1/run",
        {"stage_id": 0, "stage_input": {"prompt": "hi"}, "sampling_params": sampling},
    )
    assert status == 400, body[:500]
    assert field in json.loads(body)["error"]["message"]


def test_a_realtime_cancel_aborts_the_responses_vllm_requests(topo: Topology) -> None:
    """``response.cancel`` on a realtime session: response.done(cancelled) and no audio after
    it, and the vLLM requests of the response, the thinker's and the talker's, are aborted in
    their engines (each stage counts a cancelled request; nothing is left running)."""
    sdk = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
    vllm_urls = topo.urls[0] + topo.urls[1]

    def cancelled_at(stage_id: int) -> float:
        return sum(
            topo.metric(u, "omni_stage_requests_total", outcome="cancelled")
            for u in topo.urls[stage_id]
        )

    before = [cancelled_at(0), cancelled_at(1)]
    try:
        with sdk.realtime.connect(model=PIPELINE) as conn:
            until(conn, "session.created")
            conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "tell me a very long story"}],
                }
            )
            until(conn, "conversation.item.done")
            # Cancelled while both vLLM stages hold the response's work, however busy the
            # machine: every engine is held (SIGSTOP) before the response starts; the thinker
            # runs in slices of a millisecond until its first token is out (one token: its
            # answer begun and not done; the tiny model samples its end of text at random, from
            # the fifth token on in 300 answers); that token's hop reaches a held talker; the
            # engines continue once the cancel reached both stages, and find the abort waiting.
            # (Cancelled unheld, the thinker had sometimes finished, and talkers that kept up
            # with it had sometimes no hop left.)
            (thinker_url,) = topo.urls[0]

            def thinker_tokens() -> float:
                return topo.metric(thinker_url, "omni_stage_output_chunks_total")

            tokens = thinker_tokens()
            with (
                held_engines(topo, 1),
                held_engines(topo, 2),
                held_engines(topo, 0) as thinker,
            ):
                conn.response.create(response={"max_output_tokens": 400})
                first = until(conn, "response.created")[-1].response
                run_in_slices(thinker, until=lambda: thinker_tokens() > tokens, timeout=60)
                wait_until(
                    lambda: sum(topo.metric(u, "omni_stage_in_flight") for u in topo.urls[1]) > 0,
                    30,
                    interval=0.01,
                )
                conn.response.cancel()
                events = until(conn, "response.done")
                wait_until(
                    lambda: cancelled_at(0) > before[0] and cancelled_at(1) > before[1],
                    30,
                    interval=0.01,
                    message=lambda: f"cancelled at stages 0 and 1 since: {before}",
                )
            assert events[-1].response.status == "cancelled", events[-1]
            assert events[-1].response.id == first.id
    finally:
        sdk.close()

    talker_aborted = re.compile(rf"aborted key={re.escape(first.id)}(/\d+)? stage=1\b")

    def talker_lines() -> list[str]:
        logs = [p.stderr for p in topo.stages[1]]
        return [line for log in logs for line in log.splitlines() if first.id in line][-10:]

    def state() -> tuple[bool, bool, list[float], float]:
        thinker_log, *talker_logs = [p.stderr for p in topo.stages[0] + topo.stages[1]]
        cancelled = [cancelled_at(0) - before[0], cancelled_at(1) - before[1]]
        running = sum(topo.metric(u, "omni_stage_engine_running_requests") for u in vllm_urls)
        return (
            f"vLLM request aborted stage=0 id={first.id}" in thinker_log,
            any(talker_aborted.search(log) for log in talker_logs),
            cancelled,
            running,
        )

    def aborted() -> bool:
        thinker, talker, cancelled, running = state()
        return thinker and talker and min(cancelled) >= 1 and running == 0

    wait_until(
        aborted,
        30,
        interval=0.2,
        message=lambda: (
            "thinker's vLLM request aborted, a talker engine's work aborted, requests "
            f"cancelled since at stages 0 and 1, running: {state()}; the talkers' log lines "
            f"of the response: {talker_lines()}"
        ),
    )


def test_kill_9_of_a_talker_engine_mid_generation_is_replayed(topo: Topology) -> None:
    seeds = list(range(100, 106))
    expected = {seed: generate(topo, seed, max_tokens=48) for seed in seeds}
    retries_before = _hop_retries(topo)
    # Kill the engine of a talker while it generates (hops in flight there).
    results = answers_while_killing(
        topo, 1, lambda seed: generate(topo, seed, max_tokens=48), seeds
    )
    failed = {s: r for s, r in results.items() if r != expected[s]}
    assert len(results) == len(seeds) and not failed, failed
    assert _hop_retries(topo) > retries_before, "the kill hit no hop in flight"


def _hop_retries(topo: Topology) -> float:
    (thinker_url,) = topo.urls[0]
    return topo.metric(thinker_url, "omni_stage_hop_retries_total")
