"""The four measures of ``python -m benchmarks realtime`` (:mod:`benchmarks.realtime`), each on
a running qwen3-omni topology: first audio after a commit, barge-in, idle sessions' memory,
talking sessions through a talker kill."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

import aiohttp
import numpy as np

from benchmarks.measure import rss_bytes
from benchmarks.realtime_client import RATE, RealtimeConn, audio_deltas, connect, user_text
from tests.procs import wait_until
from tests.sidecar.topology import Topology, engine_pid

logger = logging.getLogger(__name__)

PIPELINE = "qwen3-omni"
MANUAL = {"audio": {"input": {"turn_detection": None}}}
BARGE_VAD = {
    "type": "server_vad",
    "silence_duration_ms": 400,
    "prefix_padding_ms": 200,
    "create_response": False,
    "interrupt_response": True,
}
ONSET_LEVEL = 500  # |sample| above this: the speech has begun (espeak-ng's is near 10^4)
PACE_MS = 20  # the barge-in speech is sent in 20 ms chunks at real time, as a microphone does


def ms(ns: int) -> float:
    return ns / 1e6


# ---- first audio after a commit --------------------------------------------------------------


@dataclass
class FirstAudio:
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stages: list[list[float]] = field(default_factory=list)  # the reference's split by stage


async def first_audio(
    url: str,
    utterance: np.ndarray,
    reps: int,
    max_tokens: int,
    between: Callable[[int], Awaitable[None]],
) -> FirstAudio:
    """Per repetition, a new session (so the thinker's input is the same each time, as in the
    in-process reference): the utterance appended, committed, then ``response.create``; the
    time from sending it to the first ``response.output_audio.delta``. ``between(rep)`` runs
    after each measured turn (the reference's turn)."""
    out = FirstAudio()
    async with aiohttp.ClientSession() as http:
        for rep in range(reps + 1):  # the first is a warm-up
            conn = await connect(http, url, PIPELINE, **MANUAL, max_output_tokens=max_tokens)
            try:
                for i in range(0, len(utterance), RATE // 10):
                    await conn.append(utterance[i : i + RATE // 10])
                await conn.send({"type": "input_audio_buffer.commit"})
                await conn.until("conversation.item.done")
                t0 = time.time_ns()
                await conn.send({"type": "response.create"})
                delta = await conn.until("response.output_audio.delta")
                done = await conn.until("response.done")
            finally:
                await conn.close()
            status = done.event["response"]["status"]
            if status not in ("completed", "incomplete"):
                raise RuntimeError(f"first-audio response ended {status}: {done.event}")
            if rep:
                out.seconds.append((delta.ns - t0) / 1e9)
                out.tokens.append(int(done.event["response"]["usage"]["output_tokens"]))
                await between(rep)
    return out


# ---- barge-in --------------------------------------------------------------------------------


@dataclass
class BargeIn:
    detected_ms: list[float] = field(default_factory=list)  # onset -> speech_started
    done_ms: list[float] = field(default_factory=list)  # onset -> response.done(cancelled)
    last_delta_ms: list[float] = field(default_factory=list)  # onset -> last audio delta (≥ 0)
    aborted_ms: list[float] = field(default_factory=list)  # onset -> every stage acknowledged
    # the same from speech_started (the VAD's word that the user speaks: what barge-in acts on)
    started_last_delta_ms: list[float] = field(default_factory=list)
    started_aborted_ms: list[float] = field(default_factory=list)
    stages_acked: list[int] = field(default_factory=list)
    deltas_after_done: int = 0


def _onset(samples: np.ndarray) -> int:
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > ONSET_LEVEL)
    return int(loud[0]) if len(loud) else 0


async def _speak(conn: RealtimeConn, audio: np.ndarray, onset: int) -> int:
    """Send ``audio`` at real time; the wall clock (ns) when the chunk with ``onset`` went."""
    step = RATE * PACE_MS // 1000
    sent_onset = 0
    start = time.monotonic()
    for k, i in enumerate(range(0, len(audio), step)):
        await asyncio.sleep(max(0.0, start + k * PACE_MS / 1000 - time.monotonic()))
        if not sent_onset and i + step > onset:
            sent_onset = time.time_ns()
        await conn.append(audio[i : i + step])
    return sent_onset


def stage_acks(topo: Topology, request_id: str) -> dict[int, int]:
    """The latest ``omni.cancel.acknowledged`` (epoch ns) of ``request_id`` per stage, from the
    spans the stage processes export on stderr."""
    acks: dict[int, int] = {}
    for stage_id, procs in topo.stages.items():
        for proc in procs:
            for line in proc.stderr.splitlines():
                if not line.startswith('{"name"') or request_id not in line:
                    continue
                span = json.loads(line)
                if span["attributes"].get("omni.request_id") != request_id:
                    continue
                for event in span["events"]:
                    if event["name"] == "omni.cancel.acknowledged":
                        ns = _iso_ns(event["timestamp"])
                        acks[stage_id] = max(acks.get(stage_id, 0), ns)
    return acks


def _iso_ns(stamp: str) -> int:
    """ns since the epoch of the console exporter's ``2026-12-03T11:41:27.534297Z``."""
    return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1e9)


async def barge_in(url: str, topo: Topology, stop: np.ndarray, reps: int) -> BargeIn:
    """Per repetition: a long spoken answer streaming, then the user's speech (at real time)
    with ``interrupt_response``: from the onset of the speech to the VAD's speech_started, to
    ``response.done(cancelled)``, to the last audio delta of the answer received, and to the
    last stage's cancel acknowledgement in the response's trace."""
    out = BargeIn()
    lead = np.zeros(RATE // 10, np.int16)
    audio = np.concatenate([lead, stop, np.zeros(RATE * 6 // 10, np.int16)])
    onset = _onset(audio)
    update = {"audio": {"input": {"turn_detection": BARGE_VAD}}}
    async with aiohttp.ClientSession() as http:
        for _ in range(reps):
            conn = await connect(http, url, PIPELINE, **update)
            try:
                await user_text(conn, "tell me a very long story about a small robot")
                await conn.send({"type": "response.create", "response": {"max_output_tokens": 400}})
                first = await conn.until("response.output_audio.delta")
                response_id = first.event["response_id"]
                t_onset = await _speak(conn, audio, onset)  # while the answer is being made
                started = await conn.until("input_audio_buffer.speech_started", within=10)
                done = await conn.until("response.done", within=10)
                await conn.until("input_audio_buffer.committed", within=10)
            finally:
                await conn.close()
            if done.event["response"]["status"] != "cancelled":
                raise RuntimeError(f"barge-in did not cancel: {done.event['response']['status']}")
            deltas = audio_deltas(conn.events, response_id)
            out.deltas_after_done += sum(1 for d in deltas if d.ns > done.ns)
            out.detected_ms.append(ms(started.ns - t_onset))
            out.done_ms.append(ms(done.ns - t_onset))
            out.last_delta_ms.append(max(0.0, ms(deltas[-1].ns - t_onset)))
            out.started_last_delta_ms.append(max(0.0, ms(deltas[-1].ns - started.ns)))

            def acked(rid: str = response_id) -> bool:
                return {0, 1} <= set(stage_acks(topo, rid))

            await asyncio.to_thread(
                wait_until, acked, 10.0, interval=0.1, message="no cancel acknowledgements"
            )
            acks = stage_acks(topo, response_id)
            out.aborted_ms.append(ms(max(acks.values()) - t_onset))
            out.started_aborted_ms.append(ms(max(acks.values()) - started.ns))
            out.stages_acked.append(len(acks))
    return out


# ---- idle sessions ---------------------------------------------------------------------------


@dataclass
class Idle:
    sessions: int
    rss_before_kib: int = 0
    rss_after_kib: int = 0
    open_s: float = 0.0

    @property
    def per_session_kib(self) -> float:
        return (self.rss_after_kib - self.rss_before_kib) / self.sessions


def rss_kib(pid: int) -> int:
    return rss_bytes(pid) // 1024


async def idle_sessions(url: str, topo: Topology, n: int) -> Idle:
    """``n`` sessions opened and left idle on one API server; its resident memory before and
    after (the warm-up session closed first, so the lazy imports are paid before)."""
    assert topo.api is not None
    pid = topo.api.pid
    out = Idle(n)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        conn = await connect(http, url, PIPELINE)
        await conn.close()

        def none_open() -> bool:
            return topo.metric(url, "omni_realtime_sessions") == 0

        await asyncio.to_thread(wait_until, none_open, 10.0, interval=0.1, message="sessions open")
        await asyncio.sleep(1.0)
        out.rss_before_kib = rss_kib(pid)
        gate = asyncio.Semaphore(32)

        async def one() -> RealtimeConn:
            async with gate:
                return await connect(http, url, PIPELINE)

        t0 = time.monotonic()
        conns = await asyncio.gather(*(one() for _ in range(n)))
        out.open_s = time.monotonic() - t0
        await asyncio.sleep(2.0)  # the store's writes done
        out.rss_after_kib = rss_kib(pid)
        await asyncio.gather(*(c.close() for c in conns))
    return out


# ---- talking sessions through a talker kill --------------------------------------------------


@dataclass
class Talking:
    sessions: int
    answered: int = 0
    failed: int = 0
    lost: int = 0  # socket closed, a timeout or an error event: the session did not go on
    killed_after_s: float = float("nan")
    seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rss_before_kib: int = 0
    rss_peak_kib: int = 0  # the API server's, sampled every 50 ms while the sessions talk

    @property
    def per_session_kib(self) -> float:
        return (self.rss_peak_kib - self.rss_before_kib) / self.sessions


async def talking_sessions(url: str, topo: Topology, n: int, max_tokens: int) -> Talking:
    """``n`` sessions each asking for a spoken answer at once; one talker replica killed
    (SIGKILL of its pod and its engine) once a tenth of them hear audio. Each session
    then asks once more on the same socket: a lost session cannot."""
    out = Talking(n)
    heard: set[int] = set()
    enough = asyncio.Event()  # a tenth of the sessions hear audio
    victim = topo.stages[1][0]
    t_start = time.monotonic()

    async def turn(conn: RealtimeConn, i: int, text: str) -> str:
        await user_text(conn, text)
        await conn.send({"type": "response.create", "response": {"max_output_tokens": max_tokens}})
        await conn.until("response.output_audio.delta", within=300)
        heard.add(i)
        if len(heard) >= max(1, n // 10):
            enough.set()
        done = await conn.until("response.done", within=300)
        return str(done.event["response"]["status"])

    async def session(http: aiohttp.ClientSession, i: int) -> None:
        t0 = time.monotonic()
        try:
            conn = await connect(http, url, PIPELINE, max_output_tokens=max_tokens)
            try:
                statuses = [await turn(conn, i, f"tell me about city number {i}")]
                statuses.append(await turn(conn, i, "and the next one?"))
            finally:
                await conn.close()
        except (ConnectionError, TimeoutError, RuntimeError, aiohttp.ClientError) as exc:
            out.lost += 1
            out.problems.append(f"session {i}: {type(exc).__name__}: {exc}")
            return
        out.seconds.append(time.monotonic() - t0)
        if all(s in ("completed", "incomplete") for s in statuses):
            out.answered += 1
        else:
            out.failed += 1
            out.problems.append(f"session {i}: responses {statuses}")

    async def killer() -> None:
        await enough.wait()
        engine = engine_pid(victim)
        os.kill(victim.pid, signal.SIGKILL)  # the pod and its engine, as a lost node
        os.kill(engine, signal.SIGKILL)
        out.killed_after_s = time.monotonic() - t_start
        logger.info("killed talker pid %d after %.1f s", victim.pid, out.killed_after_s)

    async def sample_rss(pid: int) -> None:
        while True:
            out.rss_peak_kib = max(out.rss_peak_kib, rss_kib(pid))
            await asyncio.sleep(0.05)

    assert topo.api is not None
    out.rss_before_kib = out.rss_peak_kib = rss_kib(topo.api.pid)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        helpers = [asyncio.create_task(killer()), asyncio.create_task(sample_rss(topo.api.pid))]
        try:
            await asyncio.gather(*(session(http, i) for i in range(n)))
        finally:
            for task in helpers:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    return out


def hop_retries(topo: Topology) -> float:
    """Replayed hops counted by the thinkers (the stage that hands on to the talkers)."""
    return sum(topo.metric(u, "omni_stage_hop_retries_total") for u in topo.urls[0])
