"""glm-image on omni-mesh against diffusers' ``GlmImagePipeline`` called one request at a time,
one run.

omni-mesh: the pipeline ``glm-image`` (ar -> dit on the random-weight ``tiny-glm-image``
folder) started with ``omni-up`` from the bundled deploy file, its DiT pool at 1 and at 2
replicas (1:1, 1:2). The monolith: ``GlmImagePipeline.__call__`` in a child process
(:mod:`benchmarks.image_mono`) behind the same route, one request at a time (the others wait).
The servers run one after the other, never two at once.

The client is OpenAI's SDK for all: ``images.generate(prompt, size, extra_body={seed, steps})``;
for omni-mesh streamed, ``stream=True, partial_images=2``, so its first partial image is timed
(the monolith has no previews: its first image is its whole answer). Every request is
``SIZE`` at ``STEPS`` denoising steps (the real model's default) and guidance 1.5, at
concurrency 1 and 8 (closed loop, after ``concurrency`` warm-up requests); and ``LARGE`` (the
real model's default side) at concurrency 1 on omni-mesh 1:2 and the two-thread monolith. Per
phase: images per second, latency p50/p99 (to the completed image), first partial image p50,
and the CPU each omni-mesh stage's engines used.

The stages apart: :mod:`benchmarks.image_stages`, in this process, one torch thread.

Targets (ratios of this run): omni-mesh 1:2's images/s at concurrency 8 ≥ 3x the monolith's;
omni-mesh 1:2's first partial image p50 at concurrency 1 ≤ 0.5x its whole image p50 (at each
size).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from benchmarks.common import Options, Report
from benchmarks.fabric import http_json
from benchmarks.image_stages import StageCosts, stage_costs
from benchmarks.measure import Target, md_table, percentile, ratio
from benchmarks.omni import CpuWatch
from omni_mesh.configs.loader import bundled_deploy_path
from omni_mesh.procutil import free_port
from tests.procs import ManagedProcess, clean_env

logger = logging.getLogger(__name__)

PIPELINE = "glm-image"
SIZE = 256
LARGE = 1024  # the real model's default side: one more phase at concurrency 1 (1:2, monolith)
STEPS = 50
PARTIAL_IMAGES = 2
DIT_REPLICAS = (1, 2)
TARGET_DIT_REPLICAS = 2
MONO = "GlmImagePipeline, one at a time"
MONO_THREADS = (1, 2)  # torch threads of the monolith: one as each engine runs, and every core
THROUGHPUT_BOUND = 3.0
FIRST_PARTIAL_BOUND = 0.5
SECRET = "benchmark-image-secret-0123456789"


@dataclass(frozen=True)
class Answer:
    first: float  # seconds to the first partial image (the whole image when none came)
    total: float  # seconds to the completed image


@dataclass
class Phase:
    system: str
    concurrency: int
    side: int = SIZE
    wall_s: float = 0.0
    answers: list[Answer] = field(default_factory=list)
    server_cores: float = float("nan")
    foreign_cores: float = float("nan")
    stage_cores: dict[int, float] = field(default_factory=dict)

    @property
    def images_per_s(self) -> float:
        return ratio(len(self.answers), self.wall_s)

    def total(self, q: float) -> float:
        return percentile([a.total for a in self.answers], q)

    def first(self, q: float) -> float:
        return percentile([a.first for a in self.answers], q)


def prompt(i: int) -> str:
    return f"a small 'shop {i % 100}' sign on a red wall"


async def generate(client: AsyncOpenAI, i: int, *, streamed: bool, side: int = SIZE) -> Answer:
    """One image of ``side`` x ``side``, timed from sending it."""
    extra = {"seed": i, "steps": STEPS}
    size: Any = f"{side}x{side}"
    t0 = time.monotonic()
    if not streamed:
        answer = await client.images.generate(prompt=prompt(i), size=size, extra_body=extra)
        if not answer.data or not answer.data[0].b64_json:
            raise RuntimeError("the answer holds no image")
        total = time.monotonic() - t0
        return Answer(total, total)
    first = 0.0
    kinds = []
    stream = await client.images.generate(
        prompt=prompt(i), size=size, stream=True, partial_images=PARTIAL_IMAGES, extra_body=extra
    )
    async for event in stream:
        kinds.append(event.type)
        if not first:
            first = time.monotonic() - t0
    total = time.monotonic() - t0
    want = ["image_generation.partial_image"] * PARTIAL_IMAGES + ["image_generation.completed"]
    if kinds != want:
        raise RuntimeError(f"stream of {kinds}, expected {want}")
    return Answer(first, total)


async def load(
    url: str,
    system: str,
    step: tuple[int, int, int],
    pid: int,
    *,
    streamed: bool,
) -> Phase:
    """``step`` = (concurrency, requests, side): ``concurrency`` warm-up requests, then
    ``requests`` kept ``concurrency`` in flight."""
    concurrency, requests, side = step
    phase = Phase(system, concurrency, side)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="benchmark", max_retries=0, timeout=300)
    try:
        warm = (
            generate(client, 100_000 + i, streamed=streamed, side=side) for i in range(concurrency)
        )
        await asyncio.gather(*warm)
        queue = list(range(requests))

        async def worker() -> None:
            while queue:
                answer = await generate(client, queue.pop(), streamed=streamed, side=side)
                phase.answers.append(answer)

        watch = CpuWatch(pid)
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        phase.wall_s = time.monotonic() - t0
        phase.server_cores, phase.foreign_cores = watch.stop(phase.wall_s)
        phase.stage_cores = watch.stage_cores(phase.wall_s)
    finally:
        await client.close()
    logger.info(
        "%s c=%d: %d images in %.1f s, other processes %.2f cores",
        system, concurrency, len(phase.answers), phase.wall_s, phase.foreign_cores,
    )  # fmt: skip
    return phase


# ---- the servers -----------------------------------------------------------------------------


def deploy_file(dit_replicas: int, folder: Path, *, batch_steps: bool = False) -> Path:
    """The bundled deploy file with ``dit_replicas`` DiT replicas (and ``batch_steps`` on)."""
    text = bundled_deploy_path(PIPELINE).read_text()
    edits = {"num_replicas: 1         # a 1:N": f"num_replicas: {dit_replicas}  # 1:N"}
    if batch_steps:
        edits["guidance_scale: 1.5}"] = "guidance_scale: 1.5, batch_steps: true}"
    for old, new in edits.items():
        if old not in text:
            raise RuntimeError(f"the bundled {PIPELINE} deploy file no longer reads {old!r}")
        text = text.replace(old, new)
    path = folder / f"glm-image-1-{dit_replicas}{'-batched' if batch_steps else ''}.yaml"
    path.write_text(text)
    return path


Plan = list[tuple[int, int, int]]  # (concurrency, requests, side) of each phase


async def omni_phases(
    dit_replicas: int, plan: Plan, logs: Path, *, batch_steps: bool = False
) -> list[Phase]:
    port = free_port()
    deploy = deploy_file(dit_replicas, logs, batch_steps=batch_steps)
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", PIPELINE,
            "--port", str(port), "--deploy-config", str(deploy), "--secret", SECRET,
            "--log-level", "warning", "--keep-logs"]  # fmt: skip
    name = deploy.stem.replace("glm-image", "omni-up")
    proc = ManagedProcess(argv, name=name, env=clean_env(), log_dir=logs).start()
    pod_logs: Path | None = None
    ok = False
    try:
        proc.wait_for_output(r"omni-up ready", timeout=300)
        kept = re.search(r"logs\s+(\S+) \(kept\)", proc.stdout)
        pod_logs = Path(kept.group(1)) if kept else None
        url, system = f"http://127.0.0.1:{port}", f"omni-mesh 1:{dit_replicas}"
        system += ", batch_steps" if batch_steps else ""
        phases = [await load(url, system, step, proc.pid, streamed=True) for step in plan]
        ok = True
        return phases
    finally:
        code = await asyncio.to_thread(proc.interrupt, 90.0)
        if code != 0:
            logger.warning("omni-up 1:%d exited %d on SIGINT", dit_replicas, code)
        if pod_logs is not None:  # the pods' logs: kept where a phase failed
            if ok:
                shutil.rmtree(pod_logs, ignore_errors=True)
            else:
                logger.error("%s failed; its pods' logs are in %s", name, pod_logs)


async def mono_phases(threads: int, plan: Plan, logs: Path) -> list[Phase]:
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.image_mono", "--port", str(port),
            "--threads", str(threads)]  # fmt: skip
    proc = ManagedProcess(argv, name=f"image-mono-{threads}", env=clean_env(), log_dir=logs)
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http_ready(url + "/health", timeout=180)
        running = int(http_json(url + "/health")["threads"])
        if running != threads:
            raise RuntimeError(f"the monolith runs {running} torch threads, asked for {threads}")
        system = f"{MONO}, {threads} thread{'s' if threads > 1 else ''}"
        return [await load(url, system, step, proc.pid, streamed=False) for step in plan]
    finally:
        proc.terminate(timeout=20)


# ---- the benchmark ---------------------------------------------------------------------------


async def bench(opts: Options) -> Report:
    report = Report("image", "image: glm-image on omni-mesh vs GlmImagePipeline one at a time")
    plan = [(1, opts.pick(8, 3), SIZE), (8, opts.pick(32, 8), SIZE)]
    large = [(1, opts.pick(3, 1), LARGE)]  # the target's ratio at the real model's size
    reps = opts.repetitions(3, 1)
    costs = await asyncio.to_thread(stage_costs, reps, SIZE, STEPS, prompt)
    logs = Path(tempfile.mkdtemp(prefix="omni-bench-image-"))
    failed = True
    phases: list[Phase] = []
    try:
        for replicas in DIT_REPLICAS:
            extra = large if replicas == TARGET_DIT_REPLICAS else []
            phases += await omni_phases(replicas, plan + extra, logs)
        try:
            phases += await omni_phases(TARGET_DIT_REPLICAS, plan, logs, batch_steps=True)
        except Exception as exc:  # an opt-in shown for information: the table says so
            logger.exception("the batch_steps variant failed")
            report.notes.append(
                f"The batch_steps variant failed ({type(exc).__name__}: {str(exc)[:200]}); "
                "its rows are missing."
            )
        for threads in MONO_THREADS:
            extra = large if threads == max(MONO_THREADS) else []
            phases += await mono_phases(threads, plan + extra, logs)
        failed = False
    finally:
        if failed:
            logger.error("image benchmark failed; process logs kept in %s", logs)
        else:
            shutil.rmtree(logs, ignore_errors=True)
    tables(report, phases, costs)
    return report


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


def _stage_cell(phase: Phase) -> str:
    if not phase.stage_cores:
        return "-"
    return " / ".join(f"{cores:.2f}" for cores in phase.stage_cores.values())


def best_mono(phases: list[Phase], concurrency: int, *, key: str) -> Phase:
    """The monolith's better thread count at ``concurrency``: most images/s
    (``key="throughput"``) or lowest latency p50."""
    mono = [p for p in phases if p.system.startswith(MONO) and p.concurrency == concurrency]
    if key == "throughput":
        return max(mono, key=lambda p: p.images_per_s)
    return min(mono, key=lambda p: p.total(50))


def tables(report: Report, phases: list[Phase], costs: StageCosts) -> None:
    rows = [
        [p.system, f"{p.side}x{p.side}", str(p.concurrency), str(len(p.answers)),
         f"{p.images_per_s:.2f}",
         _ms(p.total(50)), _ms(p.total(99)), _ms(p.first(50)),
         f"{ratio(p.first(50), p.total(50)):.2f}", f"{p.server_cores:.2f}", _stage_cell(p),
         f"{p.foreign_cores:.2f}"]
        for p in phases
    ]  # fmt: skip
    head = ["system", "size", "concurrency", "images", "images/s", "latency p50 ms",
            "latency p99 ms", "first partial image p50 ms", "first partial / latency, p50",
            "server CPU, cores", "engines' CPU ar / dit, cores", "other load, cores"]  # fmt: skip
    report.add(
        md_table(
            head,
            rows,
            title=f"glm-image (tiny-glm-image), {STEPS} steps, guidance 1.5, "
            f"OpenAI SDK images.generate (omni-mesh: stream, partial_images={PARTIAL_IMAGES})",
        )
    )
    report.add(
        md_table(
            ["stage", "omni-mesh engine", "GlmImagePipeline"],
            [
                ["AR prior tokens/s, 1 request", f"{costs.ar_one:,.0f}", f"{costs.ar_pipe:,.0f}"],
                ["AR prior tokens/s, 8 requests", f"{costs.ar_eight:,.0f}", "- (one at a time)"],
                [
                    "DiT step ms (glyphs, VAE decode included)",
                    f"{costs.dit_step * 1000:.2f}",
                    f"{costs.dit_pipe * 1000:.2f}",
                ],
                ["one partial image (VAE decode) ms", f"{costs.preview * 1000:.2f}", "-"],
            ],
            title=f"The stages apart: in-process, one torch thread, {SIZE}x{SIZE} "
            f"({costs.ar_tokens} prior tokens a request), {STEPS} steps, p50",
        )
    )
    by = {(p.system, p.concurrency): p for p in phases if p.side == SIZE}
    ours = f"omni-mesh 1:{TARGET_DIT_REPLICAS}"
    mono8 = best_mono(phases, 8, key="throughput")
    report.targets.append(
        Target(
            f"{ours} images/s at concurrency 8 / {mono8.system}'s",
            ratio(by[(ours, 8)].images_per_s, mono8.images_per_s),
            THROUGHPUT_BOUND,
            True,
            "x",
        )
    )
    for one in [p for p in phases if p.system == ours and p.concurrency == 1]:
        report.targets.append(
            Target(
                f"{ours} first partial image p50 / its whole image p50, concurrency 1, "
                f"{one.side}x{one.side}",
                ratio(one.first(50), one.total(50)),
                FIRST_PARTIAL_BOUND,
                False,
                "x",
            )
        )
    _notes(report)


def _notes(report: Report) -> None:
    report.notes.append(
        "omni-mesh is the bundled deploy file (glm-image.yaml: AR max_num_seqs 8, a DiT "
        "replica's max_num_seqs 4, batch_steps off, so every image equals the pipeline's) "
        "started by omni-up, its DiT at 1 and 2 replicas; the targets use 1:2. Each engine "
        "runs one torch thread; the monolith is one process, no hops, one request at a time, "
        "run with one torch thread and with two (torch's default here, every core); the "
        "throughput target takes the better of the two."
    )
    report.notes.append(
        "'omni-mesh 1:2, batch_steps' turns on the DiT's opt-in engine_extras.batch_steps: the "
        "running requests of one shape take each step in shared forwards, each image within a "
        "level or two of the pipeline's instead of equal (tests/engines/glm_image/"
        "test_glm_image_dit_steps.py); shown for what it buys, not used for the targets."
    )
    report.notes.append(
        "The monolith sends no previews, so its first partial image is its whole answer. "
        "omni-mesh's previews come after steps 17 and 33 of 50 (evenly spaced), each a VAE "
        "decode of the step's clean-latent estimate; the AR's whole run comes before the "
        "first, so the first partial's share of the latency is the AR's share plus a third "
        "of the DiT's: on tiny-glm-image the AR is the larger part (the table of the stages "
        "apart), on the real checkpoint its 9B AR and 7B DiT weigh otherwise."
    )
    report.notes.append(
        "'server CPU, cores': CPU time of the server's process tree per wall second; "
        "'engines' CPU ar / dit': omni-mesh's engine processes by stage (every DiT replica "
        "summed); 'other load, cores': the machine's busy time outside the client and the "
        "server tree (/proc/stat), per wall second. The phases run one after the other on "
        "the same 2 cores."
    )
