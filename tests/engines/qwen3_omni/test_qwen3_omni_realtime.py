"""Realtime sessions (``/v1/realtime``, OpenAI Realtime GA) on qwen3-omni served 1:2:1, driven
by the official SDK (``client.realtime.connect``): real speech from espeak-ng, the server's VAD,
the committed audio heard by the thinker, text and audio deltas streamed from the stages,
barge-in that cancels the response at every stage, truncation, sessions that another API server
resumes from the control plane, bad input that leaves every session unharmed."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import openai
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from omni_mesh.sidecar.api.realtime import audio_formats
from tests.procs import ManagedProcess, clean_env, wait_until
from tests.sidecar.realtime.sdk import RATE, send_audio, until
from tests.sidecar.realtime.speech import noise, silence, speech
from tests.sidecar.topology import LOCALHOST, Topology, engine_pid, free_port, http_get

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

PIPELINE = "qwen3-omni"
#: A response that ran to its end: ``incomplete`` when it hit max_output_tokens (tests keep it low).
ANSWERED = ("completed", "incomplete")
VAD = {"type": "server_vad", "silence_duration_ms": 400, "prefix_padding_ms": 200}


@pytest.fixture(scope="module")
def topo(qwen3_omni_topology: Topology) -> Iterator[Topology]:
    yield qwen3_omni_topology


@pytest.fixture(scope="module")
def sdk(topo: Topology) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
    yield client
    client.close()


@contextmanager
def session(sdk: openai.OpenAI, **update: Any) -> Iterator[Any]:
    """A connected session (``session.created`` read), updated with ``update`` if given."""
    query = {k: update.pop(k) for k in ("session_id",) if k in update}
    with sdk.realtime.connect(model=PIPELINE, extra_query=query) as conn:
        created = conn.recv()
        assert created.type == "session.created", created
        conn.created = created  # type: ignore[attr-defined]
        if update:
            conn.session.update(session={"type": "realtime", **update})
            until(conn, "session.updated")
        yield conn


def user_text(conn: Any, text: str) -> None:
    conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    until(conn, "conversation.item.done")


def pcm_of(events: list[Any]) -> np.ndarray:
    data = b"".join(
        base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
    )
    return np.frombuffer(data, "<i2")


def test_a_spoken_turn_is_detected_committed_and_answered_with_audio(sdk: openai.OpenAI) -> None:
    utterance = speech("hello there, can you tell me a short story", RATE)
    lead_ms, utterance_ms = 600, len(utterance) * 1000 // RATE
    audio = np.concatenate([noise(lead_ms, RATE, 200), utterance, silence(1200, RATE)])
    with session(sdk, audio={"input": {"turn_detection": VAD}}, max_output_tokens=6) as conn:
        send_audio(conn, audio)
        events = until(conn, "response.done")
    types = [e.type for e in events]
    started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    committed = next(e for e in events if e.type == "input_audio_buffer.committed")
    assert abs(started.audio_start_ms - lead_ms) < 250, started
    assert abs(stopped.audio_end_ms - (lead_ms + utterance_ms)) < 500, stopped
    assert started.item_id == stopped.item_id == committed.item_id
    user = next(e.item for e in events if e.type == "conversation.item.added")
    assert (user.id, user.role, user.content[0].type) == (committed.item_id, "user", "input_audio")
    order = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
    ]
    assert [types.index(t) for t in order] == sorted(types.index(t) for t in order), types
    transcript = "".join(e.delta for e in events if e.type.endswith("transcript.delta"))
    done = events[-1].response
    # the answer ran into max_output_tokens: OpenAI's "incomplete" (the audio is all there)
    assert (done.status, done.status_details.reason) == ("incomplete", "max_output_tokens")
    assert done.usage.output_tokens == 6
    (item,) = done.output
    assert item.content[0].transcript == transcript != ""
    pcm = pcm_of(events)
    assert len(pcm) > RATE  # seconds of speech, streamed in many deltas
    assert types.count("response.output_audio.delta") > 3


def test_a_silent_user_gets_a_response_after_idle_timeout_ms(sdk: openai.OpenAI) -> None:
    idle_ms = 1000  # the least the server takes
    td = {**VAD, "idle_timeout_ms": idle_ms}
    with session(sdk, audio={"input": {"turn_detection": td}}, max_output_tokens=4) as conn:
        armed = time.monotonic()
        send_audio(conn, noise(300, RATE, 150))  # noise is no speech: the timer runs on
        events = until(conn, "input_audio_buffer.timeout_triggered")
        waited = time.monotonic() - armed
        # The server armed its timer when it applied session.update, a moment before `armed`.
        assert idle_ms / 1000 - 0.05 <= waited < idle_ms / 1000 + 5.0, waited
        assert "input_audio_buffer.speech_started" not in [e.type for e in events]
        trigger = events[-1]
        events = until(conn, "response.created")
        created = time.monotonic()  # the server's first audio delta is later than this
        committed = next(e for e in events if e.type == "input_audio_buffer.committed")
        assert committed.item_id == trigger.item_id  # the noise heard so far, as the user's turn
        events = until(conn, "response.done")
        assert events[-1].response.status in ANSWERED, events[-1]
        audio_s = len(pcm_of(events)) / RATE
        assert audio_s > 0
        # Armed again after the answer, counted from the end of its playback (its audio at
        # real time from the first delta), not from response.done.
        again = until(conn, "input_audio_buffer.timeout_triggered")
        assert time.monotonic() - created >= audio_s + idle_ms / 1000 - 0.05
        assert not [e for e in again if e.type == "response.created"]


def test_speech_during_a_response_cancels_it_at_every_stage(
    sdk: openai.OpenAI, topo: Topology
) -> None:
    stage_urls = [url for urls in topo.urls.values() for url in urls]
    before = [topo.metric(u, "omni_stage_requests_total", outcome="cancelled") for u in stage_urls]
    td = {**VAD, "create_response": False, "interrupt_response": True}
    with session(sdk, audio={"input": {"turn_detection": td}}) as conn:
        user_text(conn, "tell me a very long story about a small robot")
        conn.response.create(response={"max_output_tokens": 400})
        first = until(conn, "response.output_audio.delta")
        response_id = first[-1].response_id
        send_audio(conn, np.concatenate([speech("stop, please stop", RATE), silence(800, RATE)]))
        events = until(conn, "response.done")
        done = events[-1].response
        assert done.id == response_id and done.status == "cancelled", done
        assert done.status_details.reason == "turn_detected"
        assert "input_audio_buffer.speech_started" in [e.type for e in events]
        item = done.output[0]
        assert item.status == "incomplete"
        after_done = until(conn, "input_audio_buffer.committed")
        assert not [e for e in after_done if e.type.startswith("response.output_audio")]
        # what the user heard: the assistant item cut at half the audio it was sent
        heard_ms = len(pcm_of(first + events)) * 1000 // RATE
        assert heard_ms > 0
        conn.conversation.item.truncate(
            item_id=item.id, content_index=0, audio_end_ms=heard_ms // 2
        )
        truncated = until(conn, "conversation.item.truncated")[-1]
        assert (truncated.item_id, truncated.audio_end_ms) == (item.id, heard_ms // 2)
        conn.send(
            {
                "type": "conversation.item.truncate",
                "item_id": item.id,
                "content_index": 0,
                "audio_end_ms": 10_000,
                "event_id": "cut-too-far",
            }
        )
        error = until(conn, "error")[-1].error
        assert (error.param, error.event_id) == ("audio_end_ms", "cut-too-far")

    # The thinker and the talker held the response's work (running streams): each counts a
    # cancel. code2wav runs one short hop per talker chunk; a chunk in flight is cancelled
    # too, else its stage just gets no more work: nothing runs for the response afterwards.
    def cancelled() -> bool:
        return all(
            sum(topo.metric(u, "omni_stage_requests_total", outcome="cancelled") for u in urls)
            > sum(b for b, u in zip(before, stage_urls, strict=True) if u in urls)
            for urls in (topo.urls[0], topo.urls[1])
        )

    def outcomes() -> str:
        lines = {u: http_get(u + "/metrics").decode().splitlines() for u in stage_urls}
        return repr({u: [x for x in ls if x.startswith("omni_stage_requests_total")]
                     for u, ls in lines.items()})  # fmt: skip

    wait_until(cancelled, 30, interval=0.2, message=outcomes)
    wait_until(
        lambda: sum(topo.metric(u, "omni_stage_in_flight") for u in stage_urls) == 0,
        30,
        message=outcomes,
    )
    code2wav = sum(topo.metric(u, "omni_stage_requests_total") for u in topo.urls[2])
    time.sleep(1.0)
    assert sum(topo.metric(u, "omni_stage_requests_total") for u in topo.urls[2]) == code2wav

    # The response's trace acknowledges the cancel at each stage that held its work: the
    # stage's span has omni.cancel (it left the work) then omni.cancel.acknowledged (its
    # engine stopped it, or had done its part: the thinker passing on the talker's answer),
    # all of them in the one trace of the response.
    def acks() -> dict[int, list[dict[str, Any]]]:
        found: dict[int, list[dict[str, Any]]] = {}
        for stage_id, procs in topo.stages.items():
            for span in (s for p in procs for s in spans(p.stderr, response_id)):
                if any(e["name"] == "omni.cancel" for e in span["events"]):
                    found.setdefault(stage_id, []).append(span)
        return found

    wait_until(lambda: {0, 1} <= set(acks()), 10, message=lambda: repr(acks()))
    cancelled = [span for stage_spans in acks().values() for span in stage_spans]
    assert len({span["context"]["trace_id"] for span in cancelled}) == 1
    for span in cancelled:
        names = [e["name"] for e in span["events"]]
        assert names[-2:] == ["omni.cancel", "omni.cancel.acknowledged"], span
        ack = span["events"][-1]["attributes"]
        assert ack["omni.abort"] in ("aborted", "idle") and ack["omni.abort_ms"] >= 0, span
        assert span["attributes"]["omni.outcome"] == "cancelled"
    # the talker was still making codes: its engine stopped them
    assert any(s["events"][-1]["attributes"]["omni.abort"] == "aborted" for s in acks()[1])


def spans(stderr: str, request_id: str) -> list[dict[str, Any]]:
    """The exported spans (console exporter: one JSON line each) of ``request_id``'s work."""
    found = []
    for line in stderr.splitlines():
        if line.startswith('{"name"'):
            span = json.loads(line)
            if span["attributes"].get("omni.request_id") == request_id:
                found.append(span)
    return found


def test_a_manual_turn_in_g711_is_committed_and_answered_in_g711(sdk: openai.OpenAI) -> None:
    """turn_detection null: nothing commits the buffer but the client; audio/pcma in and out
    (8 kHz, one byte a sample), resampled for the thinker and from the code2wav stage."""
    pcma = {"type": "audio/pcma"}
    audio = {"input": {"turn_detection": None, "format": pcma}, "output": {"format": pcma}}
    with session(sdk, audio=audio, max_output_tokens=6) as conn:
        spoken = np.concatenate([speech("what is the weather like", 8000), silence(600, 8000)])
        data = audio_formats.encode("audio/pcma", spoken)
        for i in range(0, len(data), 800):  # 100 ms a chunk
            conn.input_audio_buffer.append(audio=base64.b64encode(data[i : i + 800]).decode())
        time.sleep(0.5)  # nothing commits it by itself
        conn.input_audio_buffer.commit()
        committed = until(conn, "input_audio_buffer.committed")
        assert not [e for e in committed if e.type.startswith("input_audio_buffer.speech")]
        conn.response.create()
        events = until(conn, "response.done")
        assert events[-1].response.status in ANSWERED
        out = b"".join(
            base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
        )
        wave = audio_formats.decode("audio/pcma", out)
        assert len(wave) == len(out) and len(wave) > 8000 // 2  # > 0.5 s at 8 kHz
        assert np.abs(wave.astype(np.int32)).max() > 0
        # usage: the committed turn's seconds in, the answer's seconds out
        usage = events[-1].response.usage
        assert usage is not None
        omni = (usage.model_extra or {})["omni"]
        assert omni["audio_in_seconds"] == pytest.approx(len(spoken) / 8000, abs=0.01)
        assert omni["audio_out_seconds"] > 0.5
    user = next(e.item for e in committed + events if e.type == "conversation.item.done")
    assert (user.role, user.content[0].type) == ("user", "input_audio")


def test_sessions_and_responses_are_counted_in_metrics(sdk: openai.OpenAI, topo: Topology) -> None:
    """The API server's /metrics: sessions by state while a socket holds one (and not after),
    responses by status, the first audio's latency, the response's audio SLOs."""

    def metric(name: str, **labels: str) -> float:
        return topo.metric(topo.api_url, name, pipeline=PIPELINE, **labels)

    responses = metric("omni_realtime_responses_total")
    first_audio = metric("omni_realtime_first_audio_seconds_count")
    slo_first = metric("omni_api_audio_first_seconds_count", route="/v1/realtime")
    slo_audio = metric("omni_api_audio_seconds_total", route="/v1/realtime")
    idle = metric("omni_realtime_sessions", state="idle")
    with session(sdk, max_output_tokens=4) as conn:
        assert metric("omni_realtime_sessions", state="idle") == idle + 1
        user_text(conn, "count to three")
        conn.response.create()
        done = until(conn, "response.done")[-1].response
        status = done.status
        assert status in ANSWERED
        # usage: the thinker's tokens, and each stage's engine seconds and the audio out
        assert done.usage is not None and done.usage.output_tokens > 0
        omni = (done.usage.model_extra or {})["omni"]
        assert min(omni["engine_seconds"].values()) > 0 and omni["audio_out_seconds"] > 0
        assert metric("omni_realtime_responses_total", status=status) >= 1
        assert metric("omni_realtime_responses_total") == responses + 1
        assert metric("omni_realtime_first_audio_seconds_count") == first_audio + 1
        # The audio SLOs of the response (observability/audio_slo.py), route /v1/realtime.
        assert metric("omni_api_audio_first_seconds_count", route="/v1/realtime") == slo_first + 1
        assert metric("omni_api_audio_seconds_total", route="/v1/realtime") > slo_audio
    wait_until(lambda: metric("omni_realtime_sessions", state="idle") == idle, 10)


def test_bad_events_get_errors_and_the_session_goes_on(sdk: openai.OpenAI) -> None:
    with session(sdk) as conn:
        cases: list[tuple[str, str | None, str]] = [
            (
                '{"type": "input_audio_buffer.append", "audio": "@@@", "event_id": "e1"}',
                "audio",
                "invalid_audio",
            ),
            (
                '{"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "e2"}',
                "audio",
                "invalid_audio",
            ),
            (
                '{"type": "input_audio_buffer.commit", "event_id": "e3"}',
                None,
                "input_audio_buffer_commit_empty",
            ),
            ('{"type": "nope.nope", "event_id": "e4"}', "type", "unknown_event_type"),
            ('{"type": "response.cancel", "event_id": "e5"}', None, "response_cancel_not_active"),
            (
                '{"type": "conversation.item.delete", "item_id": "x", "event_id": "e6"}',
                "item_id",
                "invalid_value",
            ),
        ]
        for raw, param, code in cases:
            conn.send(json.loads(raw))
            error = until(conn, "error")[-1].error
            assert (error.param, error.code) == (param, code), (raw, error)
            assert error.event_id == json.loads(raw)["event_id"]
        conn._connection.send("{not json")  # the SDK only sends what it can encode
        assert until(conn, "error")[-1].error.code == "invalid_json"
        conn.session.update(session={"type": "realtime", "instructions": "still here"})
        assert until(conn, "session.updated")[-1].session.instructions == "still here"


def mutate(event: dict[str, Any], rng: random.Random) -> str:
    """One mutated event: a field dropped, retyped or renamed, or the JSON text damaged."""
    text = json.dumps(event)
    choice = rng.random()
    if choice < 0.3:
        i = rng.randrange(len(text))
        return text[:i] + rng.choice(['"', "{", "]", ",", "\\", "\x00", "é", ""]) + text[i + 1 :]
    mutated = json.loads(text)
    keys = [k for k in mutated if k != "type"]
    if choice < 0.5 and keys:
        del mutated[rng.choice(keys)]
    elif choice < 0.7 and keys:
        mutated[rng.choice(keys)] = rng.choice([None, 3, -1, 1e308, "x" * 300, [], {"a": 1}, True])
    elif choice < 0.85:
        mutated[rng.choice(["extra", "sesion", "item_id"])] = rng.choice([1, "x", None])
    else:
        mutated["type"] = rng.choice(["session.update", "conversation.item.create", "x" * 90, 7])
    return json.dumps(mutated)


SEEDS: list[dict[str, Any]] = [
    {
        "type": "session.update",
        "session": {
            "type": "realtime",
            "instructions": "x",
            "audio": {"input": {"turn_detection": None, "format": {"type": "audio/pcmu"}}},
        },
    },
    {"type": "input_audio_buffer.append", "audio": "AAAA"},
    {"type": "input_audio_buffer.commit"},
    {"type": "input_audio_buffer.clear"},
    {
        "type": "conversation.item.create",
        "previous_item_id": "root",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hi"}],
        },
    },
    {"type": "conversation.item.delete", "item_id": "item_1"},
    {"type": "conversation.item.retrieve", "item_id": "item_1"},
    {
        "type": "conversation.item.truncate",
        "item_id": "item_1",
        "content_index": 0,
        "audio_end_ms": 5,
    },
    {"type": "response.cancel"},
]


def test_thousands_of_mutated_events_harm_no_session(sdk: openai.OpenAI, topo: Topology) -> None:
    rng = random.Random(18)
    url = topo.api_url.replace("http://", "ws://") + f"/v1/realtime?model={PIPELINE}"
    with session(sdk, instructions="bystander") as bystander, ws_connect(url) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": {
                        "audio": {"input": {"turn_detection": None}},
                        "output_modalities": ["text"],
                    },
                }
            )
        )
        sent = 2000
        for _ in range(sent):
            ws.send(mutate(rng.choice(SEEDS), rng))
        ws.send(
            json.dumps({"type": "conversation.item.retrieve", "item_id": "x", "event_id": "end"})
        )
        seen: dict[str, int] = {}
        while True:
            event = json.loads(ws.recv(timeout=30))
            seen[event["type"]] = seen.get(event["type"], 0) + 1
            if event["type"] == "error" and event["error"]["event_id"] == "end":
                break
        assert seen.get("error", 0) > sent // 3, seen
        assert "response.created" not in seen  # none of it started a response
        ws.send(json.dumps({"type": "session.update", "session": {"instructions": "alive"}}))
        while (event := json.loads(ws.recv(timeout=10)))["type"] != "session.updated":
            pass
        assert event["session"]["instructions"] == "alive"
        bystander.session.update(session={"type": "realtime", "instructions": "unharmed"})
        assert until(bystander, "session.updated")[-1].session.instructions == "unharmed"
    assert "Traceback" not in (topo.log_dir / f"{PIPELINE}-api.err").read_text()


def test_a_client_that_never_reads_is_disconnected(topo: Topology) -> None:
    url = topo.api_url.replace("http://", "ws://") + f"/v1/realtime?model={PIPELINE}"
    with ws_connect(url, max_size=None) as ws:
        ws.recv(timeout=10)
        text = "word " * 40_000  # 200 kB an answer
        ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "id": "big",
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": text}],
                    },
                }
            )
        )
        for _ in range(200):  # 40 MB of answers asked for, none read
            ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "big"}))
        # The server overflows within milliseconds of the first ~20 answers and then waits up to
        # CLOSE_GRACE_S (2 s) for the socket to take its last words (the error) before it
        # closes: read well within that (with 2 s here, a run under load lost the error).
        time.sleep(0.5)
        last: dict[str, Any] = {}
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                last = json.loads(ws.recv(timeout=20))
        assert last["type"] == "error" and last["error"]["code"] == "slow_consumer", last
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def second_api(topo: Topology, *flags: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    proc = ManagedProcess(
        topo._stage_argv(0, port, "--api-only", *flags),
        name=f"{PIPELINE}-api2",
        env=clean_env(),
        log_dir=topo.log_dir,
    ).start()
    url = f"http://{LOCALHOST}:{port}"
    proc.wait_http_ready(url + "/health", timeout=60)
    return proc, url


def test_another_api_server_resumes_the_session_and_fences_the_first(topo: Topology) -> None:
    proc, url2 = second_api(topo, "--realtime-max-sessions", "1")
    sdk1 = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
    sdk2 = openai.OpenAI(base_url=f"{url2}/v1", api_key="none", max_retries=0)
    try:
        with session(sdk1, output_modalities=["text"], max_output_tokens=4) as conn:
            session_id = conn.created.session.id
            user_text(conn, "remember the word kettle")
            conn.response.create()
            answer = until(conn, "response.done")[-1].response
            assert answer.status in ANSWERED
        with session(sdk2, session_id=session_id) as resumed:
            assert resumed.created.session.id == session_id
            assert resumed.created.session.output_modalities == ["text"]  # its config too
            items = [
                e.item
                for e in until(
                    resumed, "conversation.item.done", where=lambda e: e.item.role == "assistant"
                )
            ]
            texts = [i.content[0] for i in items if i.role == "user"]
            assert texts[0].text == "remember the word kettle"
            user_text(resumed, "what was the word?")
            resumed.response.create()
            assert until(resumed, "response.done")[-1].response.status in ANSWERED
            at_limit = pytest.raises(Exception, match="503")  # its limit: 1 session
            with at_limit, sdk2.realtime.connect(model=PIPELINE) as extra:
                extra.recv()
            with session(sdk1, session_id=session_id) as third:  # back on the first server
                assert third.created.session.id == session_id
                resumed.conversation.item.create(
                    item={
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "x"}],
                    }
                )
                error = until(resumed, "error")[-1].error
                assert error.code == "session_taken"
        with (
            pytest.raises(Exception, match="404"),
            sdk1.realtime.connect(model=PIPELINE, extra_query={"session_id": "sess_none"}) as c,
        ):
            c.recv()
    finally:
        sdk1.close()
        sdk2.close()
        proc.terminate(timeout=20)


def test_killing_a_talker_mid_response_loses_no_session(topo: Topology) -> None:
    sdk = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
    results: dict[int, Any] = {}

    def talk(n: int) -> None:
        try:
            with session(sdk, max_output_tokens=6) as conn:
                user_text(conn, f"story number {n}")
                conn.response.create()
                results[n] = until(conn, "response.done")
        except Exception as exc:  # reported below
            results[n] = exc

    threads = [threading.Thread(target=talk, args=(n,)) for n in range(2)]
    try:
        for t in threads:
            t.start()
        victim_index = _kill_a_busy_talker(topo)
        for t in threads:
            t.join(180)
        for n in range(2):
            events = results[n]
            assert not isinstance(events, Exception), events
            assert events[-1].response.status in ANSWERED, events[-1]
            assert len(pcm_of(events)) > RATE
        assert topo.metric(topo.urls[0][0], "omni_stage_hop_retries_total") >= 1
    finally:
        sdk.close()
        _replace(topo, 1, victim_index)


def _kill_a_busy_talker(topo: Topology) -> int:
    def busy() -> int | None:
        for i, url in enumerate(topo.urls[1]):
            if topo.metric(url, "omni_stage_in_flight") >= 1:
                return i
        return None

    found: list[int] = []

    def one_busy() -> bool:
        i = busy()
        if i is not None:
            found.append(i)
        return i is not None

    wait_until(one_busy, 60, interval=0.01)
    os.kill(engine_pid(topo.stages[1][found[0]]), signal.SIGKILL)
    return found[0]


def _replace(topo: Topology, stage_id: int, index: int) -> None:
    """The killed replica's pod (it exits with its engine) replaced: the chat tests that share
    this topology want two talkers."""
    dead = topo.stages[stage_id].pop(index)
    topo.urls[stage_id].pop(index)
    dead.terminate(timeout=20)
    topo.add_replica(stage_id)
    topo.wait_discovered(stage_id, len(topo.stages[stage_id]), timeout=120)
