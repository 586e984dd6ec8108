"""Realtime sessions (``/v1/realtime``, OpenAI Realtime GA) on qwen3-omni served 1:2:1: what a
voice agent's user feels, and what a session costs the API server. One run:

1. **First audio after a commit.** A spoken turn (espeak-ng speech, 24 kHz PCM) appended and
   committed with turn detection off, then ``response.create``: the time from sending it to the
   first ``response.output_audio.delta``, a new session per repetition. The **model alone** is
   the same three stage engines in one process (:mod:`benchmarks.realtime_reference`: their
   :class:`EngineCore`, one torch thread each as in the pods), stepped back to back on the same
   input until code2wav's first audio chunk, its turns taken between the fabric's (the
   topology up and idle meanwhile); the fabric's share is the difference of the p50s.
2. **Barge-in.** A long spoken answer streams; the user's speech is sent at real time (20 ms
   chunks) with ``server_vad`` and ``interrupt_response``. From the speech onset (the wall clock
   when the chunk holding it was sent) to the VAD's ``speech_started``, to
   ``response.done(cancelled)``, to the last audio delta of the answer received, and to the
   last ``omni.cancel.acknowledged`` in the response's trace (the stages' spans, console
   exporter; the same wall clock on this machine).
3. **Idle sessions.** N sessions opened on one API server and left idle: its resident memory
   (VmRSS) before and after, per session.
4. **Talking sessions through a talker kill.** N sessions each ask for a spoken answer at once
   and then once more; one of the two talker replicas (pod and engine) gets SIGKILL once a
   tenth of them hear audio. A session is lost when its socket closes, a response fails or it
   stalls.

Targets (the issue's): the fabric adds ≤ 5 ms to the first audio delta; ≤ 50 ms from speech
start (``speech_started``) to the last audio delta sent; ≤ 100 ms until every stage has
aborted; 1,000 idle sessions per API server at ≤ 50 KiB each; 0 sessions lost with a talker
killed under 50 talking sessions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import Options, Report
from benchmarks.measure import Target, md_table, percentile
from benchmarks.realtime_client import RATE
from benchmarks.realtime_phases import (
    PIPELINE,
    BargeIn,
    FirstAudio,
    Idle,
    Talking,
    barge_in,
    first_audio,
    hop_retries,
    idle_sessions,
    talking_sessions,
)
from omni_mesh.configs.loader import bundled_deploy_path
from tests.procs import clean_env
from tests.sidecar.realtime.speech import speech
from tests.sidecar.topology import Topology

logger = logging.getLogger(__name__)

REPLICAS = [1, 2, 1]
MAX_TOKENS = 4  # the thinker's tokens per first-audio answer (the tiny thinker never stops early)
TALK_TOKENS = 4
UTTERANCE = "hello there, can you tell me a short story"
#: Answers of 128 talker frames (10 s of speech) instead of the bundled 64, so that a barge-in
#: finds the answer still being made (the tiny talker never ends an answer by itself).
TALKER_OVERRIDE = {"1": {"engine_extras": {"max_frames": 128}}}
FABRIC_BOUND_MS = 5.0
LAST_DELTA_BOUND_MS = 50.0
ABORT_BOUND_MS = 100.0
IDLE_BOUND_KIB = 50.0


class Reference:
    """The model alone (:mod:`benchmarks.realtime_reference` ``--serve``) in a child process,
    one repetition per :meth:`turn`, so that its turns interleave with the fabric's and both
    see the same machine."""

    def __init__(self, utterance: np.ndarray, log_dir: Path) -> None:
        self.pcm = log_dir / "utterance.pcm"
        utterance.astype("<i2").tofile(self.pcm)
        self.stderr = (log_dir / "realtime-reference.err").open("wb")
        self.proc: asyncio.subprocess.Process | None = None
        self.result = FirstAudio()

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.realtime_reference", "--serve",
            "--max-tokens", str(MAX_TOKENS), "--audio-file", str(self.pcm),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=self.stderr,
            env=clean_env(),
        )  # fmt: skip
        if await self._line(300) != "ready":
            raise RuntimeError("the realtime reference did not start (see its stderr)")

    async def _line(self, within: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), within)
        if not line:
            raise RuntimeError(f"the realtime reference exited ({self.proc.returncode})")
        return line.decode().strip()

    async def turn(self, seed: int) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"{seed}\n".encode())
        await self.proc.stdin.drain()
        data = json.loads(await self._line(120))
        self.result.seconds.append(sum(data["stages"]))
        self.result.stages.append(list(data["stages"]))
        self.result.tokens.append(int(data["tokens"]))

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        self.stderr.close()


def raise_fd_limit(wanted: int = 16_384) -> None:
    """Room for thousands of sockets here and in the API server (its limit is inherited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def bench(opts: Options) -> Report:
    report = Report("realtime", "realtime: /v1/realtime sessions on qwen3-omni 1:2:1")
    reps = opts.reps or opts.pick(20, 5)
    barge_reps = opts.reps or opts.pick(10, 3)
    idle_n, talking_n = opts.pick(1000, 200), opts.pick(50, 12)
    log_dir = Path(tempfile.mkdtemp(prefix="omni-bench-realtime-"))
    utterance = speech(UTTERANCE, RATE)
    stop = speech("stop, please stop", RATE)
    raise_fd_limit()
    failed = True
    ref = Reference(utterance, log_dir)
    try:
        await ref.start()
        config = ["--deploy-config", str(bundled_deploy_path(PIPELINE)), "--tracing", "console",
                  "--stage-overrides", json.dumps(TALKER_OVERRIDE)]  # fmt: skip
        topo = Topology(PIPELINE, REPLICAS, log_dir, extra_stage_args=config)
        try:
            await asyncio.to_thread(topo.start)
            for stage_id, count in enumerate(REPLICAS):
                await asyncio.to_thread(topo.wait_discovered, stage_id, count, 120)
            url = topo.api_url
            fabric = await first_audio(url, utterance, reps, MAX_TOKENS, ref.turn)
            await ref.close()  # its memory and threads out of the way of the next phases
            barge = await barge_in(url, topo, stop, barge_reps)
            idle = await idle_sessions(url, topo, idle_n)
            retries0 = hop_retries(topo)
            talking = await talking_sessions(url, topo, talking_n, TALK_TOKENS)
            retries = hop_retries(topo) - retries0
        finally:
            await asyncio.to_thread(topo.close)
        failed = False
    finally:
        await ref.close()
        if failed:
            logger.error("realtime benchmark failed; process logs kept in %s", log_dir)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    tables(report, fabric, ref.result, barge, idle, talking, retries)
    return report


def _ms(values: list[float], q: float, scale: float = 1.0) -> str:
    return f"{percentile(values, q) * scale:,.1f}" if values else "n/a"


def tables(
    report: Report,
    fabric: FirstAudio,
    ref: FirstAudio,
    barge: BargeIn,
    idle: Idle,
    talking: Talking,
    retries: float,
) -> None:
    share_ms = (percentile(fabric.seconds, 50) - percentile(ref.seconds, 50)) * 1000
    if ref.stages:
        split = " / ".join(f"{np.median([s[k] for s in ref.stages]) * 1000:.1f}" for k in range(3))
        report.notes.append(
            f"The model alone, p50 by stage (thinker until it hands on / the talker's first "
            f"chunk / code2wav's decode of it): {split} ms."
        )
    rows = [
        ["omni-mesh /v1/realtime, 1:2:1", str(len(fabric.seconds)), _ms(fabric.seconds, 50, 1e3),
         _ms(fabric.seconds, 99, 1e3), f"{np.median(fabric.tokens):.0f}"],
        ["model alone (3 engine cores, one process)", str(len(ref.seconds)),
         _ms(ref.seconds, 50, 1e3), _ms(ref.seconds, 99, 1e3), f"{np.median(ref.tokens):.0f}"],
    ]  # fmt: skip
    report.add(
        md_table(
            ["system", "turns", "first audio p50 ms", "p99 ms", "thinker tokens"],
            rows,
            title=f"First audio delta after a committed spoken turn (fabric's share p50: "
            f"{share_ms:,.1f} ms)",
        )
    )
    rows = [
        ["onset → input_audio_buffer.speech_started", _ms(barge.detected_ms, 50),
         _ms(barge.detected_ms, 99)],
        ["onset → response.done (cancelled)", _ms(barge.done_ms, 50), _ms(barge.done_ms, 99)],
        ["onset → last audio delta of the answer received", _ms(barge.last_delta_ms, 50),
         _ms(barge.last_delta_ms, 99)],
        ["onset → last stage's omni.cancel.acknowledged", _ms(barge.aborted_ms, 50),
         _ms(barge.aborted_ms, 99)],
        ["speech_started → last audio delta of the answer received",
         _ms(barge.started_last_delta_ms, 50), _ms(barge.started_last_delta_ms, 99)],
        ["speech_started → last stage's omni.cancel.acknowledged",
         _ms(barge.started_aborted_ms, 50), _ms(barge.started_aborted_ms, 99)],
    ]  # fmt: skip
    report.add(
        md_table(
            [
                "from the user's speech (onset sent, or the VAD's speech_started)",
                "p50 ms",
                "p99 ms",
            ],
            rows,
            title=f"Barge-in ({len(barge.done_ms)} interruptions; audio deltas after "
            f"response.done: {barge.deltas_after_done}; stages acknowledging: "
            f"{sorted(set(barge.stages_acked))})",
        )
    )
    rows = [
        [f"{idle.sessions} idle", f"{idle.rss_before_kib / 1024:,.1f}",
         f"{idle.rss_after_kib / 1024:,.1f}", f"{idle.per_session_kib:,.1f}",
         f"opened in {idle.open_s:.1f} s"],
        [f"{talking.sessions} talking", f"{talking.rss_before_kib / 1024:,.1f}",
         f"{talking.rss_peak_kib / 1024:,.1f}", f"{talking.per_session_kib:,.1f}",
         "peak while they talk (text turns in, audio out)"],
    ]  # fmt: skip
    report.add(
        md_table(
            [
                "sessions on one API server",
                "RSS before MiB",
                "RSS after MiB",
                "KiB per session",
                "notes",
            ],
            rows,
            title="Sessions on one API server: its resident memory (VmRSS)",
        )
    )
    rows = [
        [str(talking.sessions), str(talking.answered), str(talking.failed), str(talking.lost),
         f"{talking.killed_after_s:.1f}", f"{retries:.0f}", _ms(talking.seconds, 50),
         _ms(talking.seconds, 99)],
    ]  # fmt: skip
    report.add(
        md_table(
            [
                "sessions",
                "answered twice",
                "a response failed",
                "lost",
                "talker killed at s",
                "hops replayed",
                "session p50 s",
                "session p99 s",
            ],
            rows,
            title="Talking sessions, one talker replica killed (SIGKILL, pod and engine)",
        )
    )
    if talking.problems:
        report.notes.append("Problems: " + "; ".join(talking.problems[:5]))
    report.targets += [
        Target("fabric's share of the first audio delta (p50 minus the model alone's)", share_ms,
               FABRIC_BOUND_MS, False, "ms"),
        Target("speech_started → last audio delta, p99",
               percentile(barge.started_last_delta_ms, 99), LAST_DELTA_BOUND_MS, False, "ms"),
        Target("speech_started → every stage aborted, p99",
               percentile(barge.started_aborted_ms, 99), ABORT_BOUND_MS, False, "ms"),
        Target(f"memory per idle session ({idle.sessions} on one API server)",
               idle.per_session_kib, IDLE_BOUND_KIB, False, "KiB"),
        Target(f"sessions lost, talker killed under {talking.sessions} talking",
               float(talking.lost + talking.failed), 0.0, False, ""),
    ]  # fmt: skip
    _notes(report)


def _notes(report: Report) -> None:
    report.notes += [
        "The model alone runs the stages one after the other in one process on one core; "
        "omni-mesh runs 4 engine processes (1:2:1), their sidecars, the API server, omni-cp, "
        "Redis and the client on the same 2 cores, so the fabric's share includes the waits "
        "for a core as well as the hops (API server → thinker → talker → code2wav, the "
        "frames streamed back), the WebSocket and the session's events.",
        "The barge-in onset is when the client sent the 20 ms chunk holding the first loud "
        "sample of the speech. The targets count from input_audio_buffer.speech_started, the "
        "moment the server knows the user speaks (what a barge-in acts on); the onset rows add "
        "the VAD's own detection time (Silero on 32 ms frames, threshold 0.5: it needs voiced "
        "frames, not the first loud sample). response.done(cancelled) is sent in "
        "the same event-loop turn as the cancel and the queued audio deltas are dropped, so no "
        "audio delta follows it; the stages' acknowledgements are the talker's and the "
        "thinker's (code2wav holds a response's work only while it decodes a chunk).",
        "vLLM's own /v1/realtime is a transcription endpoint (audio in, text out, one model, "
        "no audio output and no response.cancel), so none of these measures applies to it as "
        "they are; it was not run.",
    ]
