"""qwen3-omni on omni-mesh against the same model served whole with transformers, one run.

The pipeline ``qwen3-omni`` (thinker -> talker -> code2wav, Qwen3-Omni-MoE's real architecture
on the random-weight ``tiny-qwen3-omni`` folder) is started with ``omni-up`` (``python -m
omni_mesh.launcher.cli``, the bundled deploy config: ``async_chunk`` on, so code2wav's audio
streams to the client as it is decoded), at replicas 1:1:1 and at the bundled 1:2:1. The
monolithic reference is transformers' own ``Qwen3OmniMoeForConditionalGeneration.generate``
behind a small aiohttp server in a child process (:mod:`benchmarks.omni_mono`), served one
request at a time (the others queue) and batched (every request waiting, up to 8, in one left-
padded ``generate``). The servers run one after the other, never two at once.

The client is the same for all: OpenAI's SDK, ``client.audio.speech.with_streaming_response
.create(model="qwen3-omni", input=..., voice="ethan", response_format="pcm")`` read with
``iter_bytes()``, at concurrency 1 and 8 (closed loop: each client sends its next request when
its answer is complete), after ``concurrency`` warm-up requests. Per request: first audio byte
(wall time from sending to the first PCM byte; the monolith has only the whole answer, so for it
that is the whole answer), whole answer, audio seconds (PCM16 at 24 kHz), real-time factor
(whole answer / audio seconds). Per phase: audio seconds produced per wall second, all clients.

Targets (ratios of this run): omni-mesh's (1:2:1) first audio byte p50 at concurrency 1 ≤ 0.3x
the monolith's whole answer p50 (the better variant); omni-mesh's (1:2:1) audio seconds per
second at concurrency 8 ≥ 2x the better monolithic variant's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from openai import AsyncOpenAI

from benchmarks.common import Options, Report
from benchmarks.fabric import http_json
from benchmarks.measure import (
    CLK_TCK,
    Target,
    cmdline,
    descendants,
    machine_busy_seconds,
    md_table,
    median,
    percentile,
    ratio,
)
from omni_mesh.procutil import free_port
from tests.procs import ManagedProcess, clean_env

logger = logging.getLogger(__name__)

PIPELINE = "qwen3-omni"
VOICE = "ethan"
SAMPLE_RATE = 24_000
BYTES_PER_SAMPLE = 2
OMNI_REPLICAS = ("1:1:1", "1:2:1")
TARGET_REPLICAS = "1:2:1"  # the bundled deploy config's
MONO_ONE = "monolithic, one at a time"
MONO_BATCHED = "monolithic, batched (≤ 8)"
MAX_BATCH = 8
ENGINE = re.compile(r"-m omni_mesh\.engines .*--stage-id (\d+)")
READY = re.compile(r"omni-up ready: \S+ \(pipeline qwen3-omni, replicas ([0-9:]+)\)")
FIRST_BYTE_BOUND = 0.3
THROUGHPUT_BOUND = 2.0


@dataclass(frozen=True)
class Answer:
    """One request as the client saw it (seconds from sending it)."""

    first: float  # first audio byte
    total: float  # last byte
    audio_s: float  # seconds of audio in the answer

    @property
    def rtf(self) -> float:
        """Real-time factor: wall time of the request / audio seconds of it."""
        return self.total / self.audio_s if self.audio_s > 0 else float("nan")


@dataclass
class Phase:
    """One system at one concurrency."""

    system: str
    concurrency: int
    wall_s: float = 0.0
    answers: list[Answer] = field(default_factory=list)
    server_cores: float = float("nan")  # CPU used by the server's process tree
    foreign_cores: float = float("nan")  # CPU used by processes not of this benchmark
    stage_cores: dict[int, float] = field(default_factory=dict)  # engine processes' CPU by stage

    def first(self, q: float) -> float:
        return percentile([a.first for a in self.answers], q)

    def total(self, q: float) -> float:
        return percentile([a.total for a in self.answers], q)

    @property
    def audio_per_s(self) -> float:
        """Audio seconds produced per wall second, over all the clients of the phase."""
        return ratio(sum(a.audio_s for a in self.answers), self.wall_s)

    @property
    def rtf(self) -> float:
        return median(a.rtf for a in self.answers)

    @property
    def audio_s(self) -> float:
        return median(a.audio_s for a in self.answers)


def pcm_seconds(nbytes: int, sample_rate: int = SAMPLE_RATE) -> float:
    """Seconds of 16-bit mono PCM in ``nbytes`` bytes."""
    return nbytes / BYTES_PER_SAMPLE / sample_rate


def foreign_cores(busy_s: float, own_s: float, wall_s: float) -> float:
    """Cores used on average by other processes: machine busy CPU seconds minus this
    benchmark's own (client and server tree), per wall second; NaN without a wall time."""
    return max(0.0, busy_s - own_s) / wall_s if wall_s > 0 else float("nan")


def stat_cpu_seconds(stat: str, clock_ticks: int = CLK_TCK) -> float:
    """utime + stime of a ``/proc/PID/stat`` line: the whole process, its exited threads
    included (an engine's per-step threads are gone before a per-thread reading sees them)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / clock_ticks


def process_cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far (0 when it is gone)."""
    try:
        return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError, IndexError):
        return 0.0


class CpuWatch:
    """This process's and a server tree's CPU time, and the whole machine's busy time."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.busy0 = machine_busy_seconds()
        self.client0 = self.client()
        self.server0 = self.server()
        self.stages0 = self.stages()

    def client(self) -> float:
        t = os.times()
        return t.user + t.system

    def server(self) -> float:
        tree = [self.root_pid, *descendants(self.root_pid)]
        return sum(process_cpu_seconds(p) for p in tree)

    def stages(self) -> dict[int, float]:
        """CPU time of the tree's engine processes (omni-mesh's), summed by stage id."""
        out: dict[int, float] = {}
        for pid in descendants(self.root_pid):
            match = ENGINE.search(cmdline(pid))
            if match:
                stage = int(match.group(1))
                out[stage] = out.get(stage, 0.0) + process_cpu_seconds(pid)
        return out

    def stage_cores(self, wall_s: float) -> dict[int, float]:
        """Cores each stage's engines used over ``wall_s`` (none for the monolith)."""
        now = self.stages()
        return {s: ratio(now[s] - self.stages0.get(s, 0.0), wall_s) for s in sorted(now)}

    def stop(self, wall_s: float) -> tuple[float, float]:
        """(cores the server tree used, cores other processes used) over ``wall_s``."""
        server = self.server() - self.server0
        own = server + self.client() - self.client0
        busy = machine_busy_seconds() - self.busy0
        return ratio(server, wall_s), foreign_cores(busy, own, wall_s)


def prompt(i: int) -> str:
    return f"Tell me about the weather in city number {i}, please."


# ---- the client ------------------------------------------------------------------------------


def new_client(url: str) -> AsyncOpenAI:
    """OpenAI's async client on ``url``, no retries (a failure is a failure)."""
    return AsyncOpenAI(base_url=url + "/v1", api_key="benchmark", max_retries=0, timeout=180.0)


async def speak(client: AsyncOpenAI, text: str) -> Answer:
    """One streamed speech request, timed from sending it."""
    t0 = time.monotonic()
    first = 0.0
    nbytes = 0
    async with client.audio.speech.with_streaming_response.create(
        model=PIPELINE, input=text, voice=VOICE, response_format="pcm"
    ) as resp:
        async for piece in resp.iter_bytes():
            if piece and not first:
                first = time.monotonic() - t0
            nbytes += len(piece)
    total = time.monotonic() - t0
    if not nbytes or nbytes % BYTES_PER_SAMPLE:
        raise RuntimeError(f"speech answer of {nbytes} bytes is no PCM16 audio")
    return Answer(first, total, pcm_seconds(nbytes))


async def load(url: str, system: str, concurrency: int, requests: int, server_pid: int) -> Phase:
    """``concurrency`` warm-up requests, then ``requests`` kept ``concurrency`` in flight; the
    other processes' CPU use meanwhile (``server_pid``: the root of the server's tree)."""
    phase = Phase(system, concurrency)
    client = new_client(url)
    try:
        await asyncio.gather(*(speak(client, prompt(10_000 + i)) for i in range(concurrency)))
        queue = list(range(requests))

        async def worker() -> None:
            while queue:
                phase.answers.append(await speak(client, prompt(queue.pop())))

        watch = CpuWatch(server_pid)
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        phase.wall_s = time.monotonic() - t0
        phase.server_cores, phase.foreign_cores = watch.stop(phase.wall_s)
        phase.stage_cores = watch.stage_cores(phase.wall_s)
    finally:
        await client.close()
    logger.info(
        "%s c=%d: %d answers in %.1f s, %.2f audio s/s, other processes %.2f cores",
        system, concurrency, len(phase.answers), phase.wall_s, phase.audio_per_s,
        phase.foreign_cores,
    )  # fmt: skip
    return phase


# ---- the servers -----------------------------------------------------------------------------


async def omni_phases(replicas: str, plan: list[tuple[int, int]], log_dir: Path) -> list[Phase]:
    """``omni-up`` of qwen3-omni at ``replicas``; stopped with SIGINT (it drains and cleans up)."""
    port = free_port()
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", PIPELINE,
            "--port", str(port), "--replicas", replicas, "--log-level", "warning"]  # fmt: skip
    name = f"omni-up-{replicas.replace(':', '-')}"
    proc = ManagedProcess(argv, name=name, env=clean_env(), log_dir=log_dir).start()
    try:
        ready = proc.wait_for_output(READY, timeout=300)
        if ready.group(1) != replicas:
            raise RuntimeError(f"omni-up runs replicas {ready.group(1)}, asked for {replicas}")
        url = f"http://127.0.0.1:{port}"
        system = f"omni-mesh {replicas}"
        return [await load(url, system, c, n, proc.pid) for c, n in plan]
    finally:
        code = await asyncio.to_thread(proc.interrupt, 90.0)
        if code != 0:
            logger.warning("omni-up %s exited %d on SIGINT", replicas, code)


async def mono_phases(
    max_batch: int, plan: list[tuple[int, int]], log_dir: Path
) -> tuple[list[Phase], int]:
    """The monolithic server (:mod:`benchmarks.omni_mono`); its phases and torch threads."""
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.omni_mono", "--port", str(port),
            "--max-batch", str(max_batch)]  # fmt: skip
    proc = ManagedProcess(argv, name=f"omni-mono-{max_batch}", env=clean_env(), log_dir=log_dir)
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http_ready(url + "/health", timeout=180)
        threads = int(http_json(url + "/health")["threads"])
        system = MONO_ONE if max_batch == 1 else MONO_BATCHED
        return [await load(url, system, c, n, proc.pid) for c, n in plan], threads
    finally:
        proc.terminate(timeout=20)


# ---- the benchmark ---------------------------------------------------------------------------


async def bench(opts: Options) -> Report:
    report = Report(
        "omni",
        "omni: qwen3-omni on omni-mesh (streamed speech) vs transformers' whole model",
    )
    n1, n8 = opts.pick(16, 6), opts.pick(48, 16)
    plan = [(1, n1), (8, n8)]
    log_dir = Path(tempfile.mkdtemp(prefix="omni-bench-omni-"))
    failed = True
    phases: list[Phase] = []
    threads = 0
    try:
        for replicas in OMNI_REPLICAS:
            phases += await omni_phases(replicas, plan, log_dir)
        mono, threads = await mono_phases(1, plan, log_dir)
        phases += mono
        try:
            batched, _ = await mono_phases(MAX_BATCH, plan, log_dir)
            phases += batched
        except Exception as exc:  # the table says so and the targets use one-at-a-time
            logger.exception("batched monolithic server failed")
            report.notes.append(
                f"Batched generate failed for this model ({type(exc).__name__}: "
                f"{str(exc)[:300]}); the monolithic rows are one-at-a-time only."
            )
        failed = False
    finally:
        if failed:
            logger.error("omni benchmark failed; process logs kept in %s", log_dir)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    tables(report, phases, threads)
    return report


def engine_cores_cell(phase: Phase) -> str:
    """thinker / talker / code2wav engine cores (every replica of a stage summed), or -."""
    if not phase.stage_cores:
        return "-"
    return " / ".join(f"{cores:.2f}" for cores in phase.stage_cores.values())


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


def best_mono(phases: list[Phase], concurrency: int, *, key: str) -> Phase:
    """The better monolithic variant at ``concurrency``: lowest whole-answer p50
    (``key="latency"``) or most audio seconds per second (``key="throughput"``)."""
    mono = [p for p in phases if p.system in (MONO_ONE, MONO_BATCHED)]
    mono = [p for p in mono if p.concurrency == concurrency]
    if not mono:
        raise RuntimeError(f"no monolithic phase at concurrency {concurrency}")
    if key == "latency":
        return min(mono, key=lambda p: p.total(50))
    return max(mono, key=lambda p: p.audio_per_s)


def tables(report: Report, phases: list[Phase], threads: int) -> None:
    rows = [
        [p.system, str(p.concurrency), str(len(p.answers)), _ms(p.first(50)), _ms(p.first(99)),
         _ms(p.total(50)), _ms(p.total(99)), f"{p.audio_per_s:.2f}", f"{p.rtf:.3f}",
         f"{p.audio_s:.2f}", f"{p.server_cores:.2f}", engine_cores_cell(p),
         f"{p.foreign_cores:.2f}"]
        for p in phases
    ]  # fmt: skip
    head = ["system", "concurrency", "requests", "first audio byte p50 ms",
            "first audio byte p99 ms", "whole answer p50 ms", "whole answer p99 ms",
            "audio s / wall s", "RTF p50", "audio s per answer", "server CPU, cores",
            "engines' CPU by stage, cores", "other load, cores"]  # fmt: skip
    report.add(
        md_table(head, rows, title="qwen3-omni (tiny-qwen3-omni), streamed /v1/audio/speech, PCM")
    )
    by = {(p.system, p.concurrency): p for p in phases}
    ours1 = by[(f"omni-mesh {TARGET_REPLICAS}", 1)]
    ours8 = by[(f"omni-mesh {TARGET_REPLICAS}", 8)]
    mono1 = best_mono(phases, 1, key="latency")
    mono8 = best_mono(phases, 8, key="throughput")
    report.targets.append(
        Target(
            f"first audio byte p50 at concurrency 1 / {mono1.system}'s whole answer p50",
            ratio(ours1.first(50), mono1.total(50)),
            FIRST_BYTE_BOUND,
            False,
            "x",
        )
    )
    report.targets.append(
        Target(
            f"audio s per second at concurrency 8 / {mono8.system}'s",
            ratio(ours8.audio_per_s, mono8.audio_per_s),
            THROUGHPUT_BOUND,
            True,
            "x",
        )
    )
    _notes(report, threads)


def _notes(report: Report, threads: int) -> None:
    report.notes.append(
        f"omni-mesh is the bundled deploy config (qwen3-omni.yaml: async_chunk on, talker "
        f"max_frames 64) started by omni-up with --replicas; the targets use the bundled "
        f"{TARGET_REPLICAS}. The tiny talker never emits its end-of-speech code, so every answer "
        "of every system is the full 64-step talker run: 63 frames of 80 ms, about 5.0 s of "
        "24 kHz audio (the 'audio s per answer' column)."
    )
    report.notes.append(
        "The monolith has only the whole waveform when generate returns, so its first audio "
        "byte is its whole answer; omni-mesh streams code2wav's chunks as they are decoded "
        "(talker chunk_frames 10), so its first byte comes after the thinker and the first "
        "talker chunk."
    )
    report.notes.append(
        "On these 2 CPU cores omni-mesh competes for cores with itself: 3 engine processes "
        "(4 at 1:2:1), one sidecar each, the API server, omni-cp and its Redis, all on the "
        "same 2 cores as the benchmark client; each engine runs one torch thread. The monolith "
        f"is one process with {threads} torch threads (torch's default here) and no hops. "
        "On this tiny model the compute per request is small, so the fixed per-hop and "
        "per-chunk costs weigh far more than they would on a real checkpoint on GPUs."
    )
    report.notes.append(
        "The batched monolith takes every request waiting when a generate starts (up to 8, "
        "left-padded, one speaker per call), with no batching window; at concurrency 1 it is "
        "batches of one. Its answers are checked only for their length (all 63 frames), not "
        "for being identical to one-at-a-time answers (sampling is on)."
    )
    report.notes.append(
        "The talker batches: every request running on a talker engine is one row of a fused "
        "step, one batched forward of the MoE talker and one batched run of its code predictor "
        "per frame (engines/qwen3_omni/talker_batch.py), as the batched monolith runs its "
        "rows. 'engines' CPU by stage' says where omni-mesh's compute goes (thinker / talker / "
        "code2wav engines, every replica of a stage summed): streamed, code2wav decodes each "
        "chunk of 10 frames after up to 25 frames of context, 199 frames decoded for an answer "
        "of 63 (3.2x one whole decode); the thinker batches too, a token for every running "
        "request per forward (engines/qwen3_omni/thinker_batch.py). The throughput target "
        "asks for twice the batched monolith's audio on the same 2 cores, where the monolith "
        "is one process without hops that uses about one core: omni-mesh would need both "
        "cores at the monolith's CPU per audio second, and its streaming context, its hops "
        "and its processes cost more than that."
    )
    report.notes.append(
        "'server CPU, cores': CPU time of the server's whole process tree (omni-up and every "
        "process under it; the monolithic server process) per wall second of the phase, from "
        "/proc/PID/stat (exited threads included). 'other load, cores': CPU the machine spent "
        "on processes that are neither the client nor the server under test while the phase "
        "was measured (/proc/stat busy time minus "
        "the client's and the server process tree's CPU time, per wall second). The phases run "
        "one after the other, so a phase with more of it had fewer of the 2 cores; the ratios "
        "of the targets are only as fair as those figures are alike."
    )
