"""streaming — what ``async_chunk`` buys and what it costs.

1. Time to first audio. The ``tiny-tts`` reference pipeline (talker → code2wav, real models on
   CPU) at 1:1, started twice side by side like every other topology here (omni-cp, one pod per
   stage, an ``--api-only`` API server): once with its bundled deploy config (``async_chunk``
   off: the talker makes every frame, code2wav decodes them, the API sends one WAV) and once
   with an overlay of it (``async_chunk: true``, talker ``chunk_frames: 10``: code2wav decodes
   every 10 frames as they come and the API streams a WAV of unknown length). The client sends
   ``POST /v1/audio/speech`` (wav, a fixed seed) at c=1 for a short, a medium and a long prompt
   (the talker makes 2 frames per prompt byte, at most 256 = 20.5 s of audio), alternating
   between the two topologies, and reads the body with ``iter_any()``: time to the first body
   byte after the WAV header (TTFA), to the last byte, and the audio's length.
2. Fabric cost of a chunk. The no-op ``synthetic`` pipeline at 1:1:1 with ``async_chunk: true``
   (0 ms stages, 64-byte outputs) three times side by side, stage 0 emitting its output in
   N = 1, 8 or 32 chunks (``output_chunks``), each of which runs stages 1 and 2 and streams
   back; c=1 ``POST /v1/generate``, the three topologies measured in turns. The cost of one
   more chunk is (p50(N) - p50(1)) / (N - 1), beside the cost of one more stage (hop + no-op
   engine) measured on the N=1 pods via ``/v1/hop``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.common import Options, Report, generate_caller, hop_caller
from benchmarks.fabric import Fabric, Pod
from benchmarks.load import LoadResult, new_session, run_load
from benchmarks.measure import CpuMeter, Target, fmt_ms, fmt_ratio, md_table, median, ratio
from benchmarks.speech import Speech, max_abs_diff, speak
from omni_mesh.configs.loader import bundled_deploy_path

TTS = "tiny-tts"
SYNTHETIC = "synthetic"
SEED = 424242
CHUNK_FRAMES = 10
SAMPLES_PER_FRAME = 1920  # code2wav at 24 kHz
PROMPTS = {
    "short": "Hello from the mesh.",
    "medium": "The quick brown fox jumps over the lazy dog while a band plays a slow, sad waltz.",
    "long": (
        "Streaming speech means the listener hears the first words while the rest is still "
        "being made: the talker hands its codec frames on in small chunks, the decoder turns "
        "each chunk into audio, and the server sends every piece the moment it exists."
    ),
}
TTFA_BOUND = 0.25  # TTFA(on, long) / total(off, long)
CHUNK_COST_BOUND_MS = 1.0
FABRIC_KINDS = ("sidecar", "engine", "API server (sidecar, --api-only)")


# ---- results -----------------------------------------------------------------------------------


CPU_KINDS = ("talker", "code2wav", "fabric")  # engines; sidecars + API server


@dataclass
class SpeechRuns:
    off: dict[str, list[Speech]] = field(default_factory=dict)
    on: dict[str, list[Speech]] = field(default_factory=dict)
    # CPU seconds per request by kind (CPU_KINDS, and "<kind> wait": runnable, not running)
    cpu: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    reps: int = 0

    def p50(self, mode: str, prompt: str, what: str) -> float:
        runs = (self.on if mode == "on" else self.off).get(prompt, [])
        return median(getattr(s, what) for s in runs)

    def cpu_p50(self, mode: str, prompt: str, kind: str) -> float:
        return median(c[kind] for c in self.cpu.get(mode, {}).get(prompt, []))


@dataclass
class ChunkRuns:
    levels: tuple[int, ...]
    requests: int
    reps: int
    runs: dict[int, list[LoadResult]] = field(default_factory=dict)
    cpu: dict[int, list[float]] = field(default_factory=dict)  # server CPU s per request
    hop1: list[LoadResult] = field(default_factory=list)  # /v1/hop to stage 2 (1 stage)
    hop3: list[LoadResult] = field(default_factory=list)  # /v1/hop to stage 0 (3 stages)

    def p(self, n: int, q: float) -> float:
        return median(r.p(q) for r in self.runs.get(n, []))

    def per_chunk(self, n: int) -> float:
        return (self.p(n, 50) - self.p(1, 50)) / (n - 1) if n > 1 else math.nan

    def step_per_chunk(self, n: int) -> float:
        """p50 added per chunk from the level below ``n`` to ``n``."""
        below = [m for m in self.levels if m < n]
        if not below:
            return math.nan
        m = max(below)
        return (self.p(n, 50) - self.p(m, 50)) / (n - m)

    def cpu_per_chunk(self, n: int) -> float:
        if n <= 1:
            return math.nan
        return (median(self.cpu.get(n, [])) - median(self.cpu.get(1, []))) / (n - 1)

    def per_stage(self) -> float:
        """p50 cost of one more no-op stage: (3-stage hop chain - 1-stage) / 2."""
        three = median(r.p(50) for r in self.hop3)
        one = median(r.p(50) for r in self.hop1)
        return (three - one) / 2


# ---- entry point -------------------------------------------------------------------------------


async def bench(opts: Options) -> Report:
    report = Report("streaming", "streaming: async_chunk time to first audio and cost per chunk")
    speech = await _speech_phase(opts)
    chunks = await _chunk_phase(opts)
    _speech_tables(report, speech)
    _chunk_tables(report, chunks)
    return report


# ---- 1. time to first audio (tiny-tts) ---------------------------------------------------------


def tts_overlay(folder: Path) -> Path:
    """The bundled tiny-tts deploy config with async_chunk on and 10-frame talker chunks."""
    path = folder / "tiny-tts-async-chunk.yaml"
    path.write_text(
        f"base_config: {bundled_deploy_path(TTS)}\n"
        "async_chunk: true\n"
        "stages:\n"
        "  - stage_id: 0\n"
        f"    engine_extras: {{chunk_frames: {CHUNK_FRAMES}}}\n"
    )
    return path


@dataclass
class _Tts:
    """One tiny-tts 1:1 topology and its process groups."""

    fab: Fabric
    talker: Pod
    code2wav: Pod
    api: Pod

    def meter(self) -> CpuMeter:
        engines = {"talker": self.talker.engine_pid(), "code2wav": self.code2wav.engine_pid()}
        groups = {k: [pid] if pid is not None else [] for k, pid in engines.items()}
        groups["fabric"] = [self.talker.pid, self.code2wav.pid, self.api.pid]
        return CpuMeter(groups)


def _start_tts(stack: contextlib.ExitStack, mode: str) -> _Tts:
    fab = Fabric(f"streaming-{mode}", pipeline=TTS)
    stack.enter_context(fab)
    if mode == "on":
        fab.deploy_config = tts_overlay(fab.log_dir)
    fab.start_cp()
    talker = fab.add_stage(0, wait=False)
    code2wav = fab.add_stage(1, wait=False)
    return _Tts(fab, talker, code2wav, fab.add_stage(0, api_only=True, wait=False))


async def _speech_phase(opts: Options) -> SpeechRuns:
    runs = SpeechRuns(reps=opts.repetitions(10, 3))
    with contextlib.ExitStack() as stack:
        tops = {mode: _start_tts(stack, mode) for mode in ("off", "on")}
        for top in tops.values():
            top.fab.wait_ready(timeout=180)
            top.fab.wait_discovered(0, 1)
            top.fab.wait_discovered(1, 1)
        async with new_session(2) as sess:
            for text in PROMPTS.values():  # warm-up: first calls of each model and shape
                for top in tops.values():
                    await speak(sess, top.api.url, TTS, text, SEED)
            for rep in range(runs.reps):
                modes = ("off", "on") if rep % 2 == 0 else ("on", "off")
                for name, text in PROMPTS.items():
                    for mode in modes:
                        await _one_speech(runs, sess, tops[mode], mode, name, text)
                print(f"[streaming] speech repetition {rep + 1}/{runs.reps} done", flush=True)
    return runs


async def _one_speech(
    runs: SpeechRuns, sess: aiohttp.ClientSession, top: _Tts, mode: str, name: str, text: str
) -> None:
    meter = top.meter()
    meter.start()
    got = await speak(sess, top.api.url, TTS, text, SEED)
    meter.stop()
    (runs.on if mode == "on" else runs.off).setdefault(name, []).append(got)
    used = {k: meter.used[k] for k in CPU_KINDS}
    used.update({f"{k} wait": meter.waited[k] for k in CPU_KINDS})
    runs.cpu.setdefault(mode, {}).setdefault(name, []).append(used)


def _reads(runs: list[Speech]) -> float:
    return median(float(s.reads) for s in runs)


def _speech_tables(report: Report, runs: SpeechRuns) -> None:
    rows = []
    for name, text in PROMPTS.items():
        on, off = runs.on[name], runs.off[name]
        frames = len(on[0].pcm) // 2 // SAMPLES_PER_FRAME
        total_off = runs.p50("off", name, "total")
        rows.append(
            [
                name,
                str(len(text.encode())),
                f"{on[0].audio_s:.2f}",
                f"{math.ceil(frames / CHUNK_FRAMES)}",
                fmt_ms(runs.p50("off", name, "ttfa"), 0),
                fmt_ms(total_off, 0),
                fmt_ms(runs.p50("on", name, "ttfa"), 0),
                fmt_ms(runs.p50("on", name, "total"), 0),
                fmt_ratio(ratio(runs.p50("on", name, "ttfa"), total_off), 3),
                fmt_ratio(ratio(runs.p50("on", name, "total"), total_off), 3),
                f"{_reads(on):.0f} / {_reads(off):.0f}",
            ]
        )
    report.add(
        md_table(
            [
                "prompt",
                "bytes",
                "audio s",
                "chunks (on)",
                "TTFA off ms",
                "total off ms",
                "TTFA on ms",
                "total on ms",
                "TTFA(on) / total(off)",
                "total(on) / total(off)",
                "body reads on / off",
            ],
            rows,
            title="Time to first audio: tiny-tts 1:1, POST /v1/audio/speech (wav), c=1",
            notes=(
                f"p50 of {runs.reps} requests per prompt and mode (after one warm-up each), the "
                "two topologies alternating. TTFA: first body byte after the WAV header; total: "
                "last body byte. 'off': the bundled deploy config; 'on': the same with "
                f"`async_chunk: true` and talker `chunk_frames: {CHUNK_FRAMES}`. 'body reads': "
                "pieces `iter_any()` returned (p50)."
            ),
        )
    )
    _cpu_table(report, runs)
    a, b = runs.on["long"][0], runs.off["long"][0]
    diff, dlen = max_abs_diff(a, b)
    same_on = all(s.pcm == a.pcm for s in runs.on["long"])
    same_off = all(s.pcm == b.pcm for s in runs.off["long"])
    report.notes.append(
        f"Sanity (long prompt, seed {SEED}): async_chunk on vs off, max |sample difference| = "
        f"{diff} int16 steps over {min(len(a.pcm), len(b.pcm)) // 2:,} samples, length "
        f"difference {dlen} samples; every repetition identical: on {same_on}, off {same_off}."
    )
    print(report.notes[-1], flush=True)
    ttfa = ratio(runs.p50("on", "long", "ttfa"), runs.p50("off", "long", "total"))
    report.targets.append(
        Target(
            "TTFA with async_chunk / total without, long prompt (p50, c=1)",
            ttfa,
            TTFA_BOUND,
            False,
            "x",
            lambda v: f"{v:.3f}",
        )
    )


def _cpu_table(report: Report, runs: SpeechRuns) -> None:
    rows = []
    for name in PROMPTS:
        for mode in ("off", "on"):
            cells = [fmt_ms(runs.cpu_p50(mode, name, k), 0) for k in CPU_KINDS]
            waits = [fmt_ms(runs.cpu_p50(mode, name, f"{k} wait"), 0) for k in CPU_KINDS[:2]]
            rows.append([name, mode, fmt_ms(runs.p50(mode, name, "total"), 0), *cells, *waits])
    report.add(
        md_table(
            [
                "prompt",
                "async_chunk",
                "total ms",
                "talker engine CPU ms",
                "code2wav engine CPU ms",
                "sidecars + API server CPU ms",
                "talker runnable-wait ms",
                "code2wav runnable-wait ms",
            ],
            rows,
            title="Where the time goes: CPU per speech request (p50)",
            notes=(
                "schedstat on-CPU time of each process over one request (the same requests as "
                "above); 'runnable-wait': time the engine's threads were ready to run but "
                "waited for a CPU. Engines run torch on one thread each."
            ),
        )
    )


# ---- 2. fabric cost of chunks (synthetic) ------------------------------------------------------


def synthetic_overlay(folder: Path) -> Path:
    """The bundled (no-op) synthetic deploy config with async_chunk on."""
    path = folder / "synthetic-async-chunk.yaml"
    path.write_text(f"base_config: {bundled_deploy_path(SYNTHETIC)}\nasync_chunk: true\n")
    return path


@dataclass
class _Synthetic:
    """One synthetic 1:1:1 topology whose stage 0 emits ``chunks`` chunks."""

    chunks: int
    fab: Fabric
    api: Pod
    s0: Pod
    s2: Pod


def _start_synthetic(stack: contextlib.ExitStack, chunks: int) -> _Synthetic:
    overrides = {"0": {"output_chunks": chunks}}
    fab = Fabric(f"streaming-chunks-{chunks}", pipeline=SYNTHETIC, stage_overrides=overrides)
    stack.enter_context(fab)
    fab.deploy_config = synthetic_overlay(fab.log_dir)
    fab.start_cp()
    s0 = fab.add_stage(0, wait=False)
    fab.add_stage(1, wait=False)
    s2 = fab.add_stage(2, wait=False)
    api = fab.add_stage(0, api_only=True, wait=False)
    return _Synthetic(chunks, fab, api, s0, s2)


def _window(meter: CpuMeter) -> Callable[[bool], None]:
    def window(opening: bool) -> None:
        (meter.start if opening else meter.stop)()

    return window


async def _chunk_phase(opts: Options) -> ChunkRuns:
    """Three topologies side by side (N = 1, 8, 32), measured in turns, so that the machine's
    noise falls on every level alike."""
    runs = ChunkRuns(
        levels=(1, 8, 32),
        requests=opts.pick(150, 40),
        reps=opts.repetitions(10, 3),
    )
    with contextlib.ExitStack() as stack:
        tops = [_start_synthetic(stack, n) for n in runs.levels]
        for top in tops:
            top.fab.wait_ready(timeout=180)
            for stage in (0, 1, 2):
                top.fab.wait_discovered(stage, 1)
        base = tops[0]  # N=1: whole outputs, so /v1/hop answers one frame
        hops = {
            "one": hop_caller(base.s2.url, 2, "one"),
            "three": hop_caller(base.s0.url, 0, "three"),
        }
        warm = opts.pick(100, 30)
        async with new_session(1) as sess:
            for fn in [*(generate_caller(t.api.url) for t in tops), *hops.values()]:
                await run_load(fn, concurrency=1, requests=warm, session=sess)
            for rep in range(runs.reps):
                turn = rep % len(tops)
                for top in tops[turn:] + tops[:turn]:
                    await _measure_chunks(runs, sess, top)
                for key, into in (("one", runs.hop1), ("three", runs.hop3)):
                    res = await run_load(
                        hops[key], concurrency=1, requests=runs.requests, session=sess
                    )
                    res.check("streaming /v1/hop")
                    into.append(res)
                print(f"[streaming] chunk-cost repetition {rep + 1}/{runs.reps} done", flush=True)
    return runs


async def _measure_chunks(runs: ChunkRuns, sess: aiohttp.ClientSession, top: _Synthetic) -> None:
    meter = CpuMeter({"fabric": top.fab.processes().pids(FABRIC_KINDS)})
    res = await run_load(
        generate_caller(top.api.url),
        concurrency=1,
        requests=runs.requests,
        session=sess,
        on_window=_window(meter),
    )
    res.check(f"streaming output_chunks={top.chunks}")
    runs.runs.setdefault(top.chunks, []).append(res)
    runs.cpu.setdefault(top.chunks, []).append(meter.used["fabric"] / res.completed)


def _chunk_tables(report: Report, runs: ChunkRuns) -> None:
    rows = []
    for n in runs.levels:
        rows.append(
            [
                str(n),
                fmt_ms(runs.p(n, 50), 3),
                fmt_ms(runs.p(n, 99), 3),
                fmt_ms(runs.per_chunk(n), 3),
                fmt_ms(runs.step_per_chunk(n), 3),
                fmt_ms(median(runs.cpu.get(n, [])), 3),
                fmt_ms(runs.cpu_per_chunk(n), 3),
            ]
        )
    stage = runs.per_stage()
    report.add(
        md_table(
            [
                "stage-0 output_chunks N",
                "p50 ms",
                "p99 ms",
                "added ms per extra chunk (p50, vs N=1)",
                "the same vs the previous N",
                "server CPU ms / request",
                "added CPU ms per extra chunk",
            ],
            rows,
            title="Fabric cost of chunks: synthetic 1:1:1 no-op, async_chunk on, "
            "POST /v1/generate, c=1",
            notes=(
                f"Median of {runs.reps} runs of {runs.requests} sequential requests per N (after "
                "a warm-up), the three topologies (one per N, side by side) measured in turns. "
                "Each chunk of stage 0 is one more engine step on stage 0, a hop to "
                "stage 1 and its engine, a hop to stage 2 and its engine, and frames streamed "
                "back to the API server. 'server CPU': user+system time of every sidecar, "
                "engine and the API server over the run, per request. For scale, one more "
                "no-op *stage* on the same pods (hop + engine; (3-stage - 1-stage) /v1/hop "
                f"chain p50 / 2, N=1): {fmt_ms(stage, 3)} ms; a chunk crosses two such stages "
                f"({fmt_ms(2 * stage, 3)} ms)."
            ),
        )
    )
    top = max(runs.levels)
    report.targets.append(
        Target(
            f"fabric cost per extra chunk (p50 c=1, N={top} vs 1)",
            runs.per_chunk(top) * 1e3,
            CHUNK_COST_BOUND_MS,
            False,
            "ms",
            lambda v: f"{v:.3f}",
        )
    )
