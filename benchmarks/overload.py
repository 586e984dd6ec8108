"""overload — goodput, fairness and shedding past capacity, through ``omni-up``.

The synthetic pipeline with a slow middle stage: stage 1 steps every 60 ms with batches of 8
(capacity about 133 requests/s), stages 0 and 2 fast. Issue 13 measured a 20 ms step; on this
2-core machine the sidecars' CPU then sets the capacity (~250/s), not the step, and the figure
would measure CPU contention rather than the queues; a 60 ms step is the bottleneck it models
(a model step on an accelerator). Clients call
``POST /v1/generate`` on omni-up's API server.

* **Closed loop** at 64, 256, 1,000 and 2,000 clients (each sends, waits for the answer, sends
  again): goodput (200s per second), p50 and p99 latency, sheds and lost requests. The
  admission queues hold the excess in FIFO order, so p99 should stay near p50 and goodput at
  capacity.
* **Open loop** at 0.5x, 1x, 2x and 3x the measured capacity (the best closed-loop goodput),
  arrivals at a fixed rate whatever the answers do, with ``max_queue_wait_s`` short (2 s):
  goodput, how fast a shed request is answered (503 + Retry-After), the admitted p99. The
  generator is :mod:`benchmarks.openloop` (prebuilt requests on keep-alive connections,
  latency from the scheduled send time).
* The API server runs alone on the last CPU (an API server deployment has CPU of its own);
  the stage pods, the control plane and the load generator (this process) on the others
  (:func:`~benchmarks.openloop.split_cpus`), capacity measured under the same pinning;
  ``OMNI_BENCH_PIN=0`` runs everything unpinned (the generator costs a few percent of a
  core: its CPU and how late it sent are in the notes either way). Ray Serve runs unpinned.
* **Ray Serve** at 2,000 clients (its ``/synthetic`` app from :mod:`benchmarks.ray_app`, run by
  ``benchmarks/.ray-venv``) when that venv exists; its own 64-client figure is the baseline.

A request is *lost* if it gets no answer or an answer other than 200 and a shed 503/429.
``--quick`` runs 64 and 1,000 clients and 1x/3x open loop, shorter. A PNG of latency against
load goes to ``docs/overload.png`` (matplotlib: the ``bench`` extra), full runs only.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path

import aiohttp

from benchmarks.autoscale_run import Deployment
from benchmarks.common import Options, Report
from benchmarks.measure import Target, fmt_num, md_table, percentile
from benchmarks.openloop import child_pids, pin_process, pinned, split_cpus
from benchmarks.overload_load import TIMEOUT_S, Run, closed_loop, open_level
from benchmarks.overload_plot import plot

# The slow stage's step: long enough that the step, not this machine's 2 CPUs, sets the
# capacity (at 20 ms the sidecars' CPU did: ~250/s of the 400/s the step allows), as a model
# step on an accelerator does in a deployment.
STEP_MS = 60.0
SEQS = 8
QUEUE_WAIT_S = 30.0  # closed loop: nothing should wait this long
API_SLOTS = 2 * 2 * SEQS  # twice stage 1's max_inflight
OPEN_QUEUE_WAIT_S = 2.0  # open loop: past 2 s of queue a request is shed at arrival

DEPLOY = """\
pipeline: synthetic
request_timeout_s: {timeout}
stages:
  - {{stage_id: 0, max_num_seqs: 64, max_inflight: 64, max_queue: 8192,
      max_queue_wait_s: {wait}}}
  - {{stage_id: 1, max_num_seqs: {seqs}, max_inflight: {inflight}, step_latency_ms: {step},
      max_queue: 8192, max_queue_wait_s: {wait}}}
  - {{stage_id: 2, max_num_seqs: 64, max_inflight: 64, max_queue: 8192,
      max_queue_wait_s: {wait}}}
"""


def deploy_yaml(wait_s: float) -> str:
    # Two batches' worth of slots at stage 1: one running, one ready for the next step.
    return DEPLOY.format(timeout=TIMEOUT_S, wait=wait_s, seqs=SEQS, inflight=2 * SEQS, step=STEP_MS)


async def api_counters(url: str) -> dict[str, float]:
    """The API server's ``omni_stage_shed_total`` by reason (``shed:<reason>``, where the
    queue forms) and its collector's passes by generation (``gc:<gen>:count``, and
    ``gc:<gen>:le:<bound>`` from ``omni_process_gc_pause_seconds``)."""
    async with aiohttp.ClientSession() as sess, sess.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        value = float(line.rsplit(" ", 1)[-1]) if line and not line.startswith("#") else 0.0
        if line.startswith("omni_stage_shed_total{"):
            key = "shed:" + line.split('reason="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + value
        elif line.startswith("omni_process_gc_pause_seconds_"):
            gen = line.split('generation="', 1)[1].split('"', 1)[0]
            if line.startswith("omni_process_gc_pause_seconds_count{"):
                out[f"gc:{gen}:count"] = value
            elif line.startswith("omni_process_gc_pause_seconds_bucket{"):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                out[f"gc:{gen}:le:{bound}"] = value
    return out


def _gc_figures(delta: dict[str, float]) -> tuple[list[int], float]:
    """Passes longer than 10 ms by generation, and the upper bound of the longest pass (s)."""
    slow, longest = [0, 0, 0], 0.0
    for gen in range(3):
        count = delta.get(f"gc:{gen}:count", 0.0)
        slow[gen] = int(count - delta.get(f"gc:{gen}:le:0.01", count))
        bounds = sorted(
            (float(k.rsplit(":", 1)[1]), v)
            for k, v in delta.items()
            if k.startswith(f"gc:{gen}:le:") and not k.endswith("+Inf")
        )
        below = 0.0
        for bound, n in bounds:
            if n > below:  # a pass ended in this bucket
                longest = max(longest, bound)
            below = n
        if count > below:
            longest = math.inf
    return slow, longest


async def _measured(url: str, load: Awaitable[Run]) -> Run:
    before = await api_counters(url)
    run = await load
    after = await api_counters(url)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    run.reasons = {k[5:]: v for k, v in delta.items() if k.startswith("shed:") and v > 0}
    run.gc_slow, run.gc_longest = _gc_figures(delta)
    return run


def _gc_cell(r: Run) -> str:
    slow = " / ".join(str(n) for n in r.gc_slow)
    return f"{slow} (≤ {r.gc_longest * 1000:g} ms)" if r.gc_longest else slow


def _reasons(r: Run) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.reasons.items())) or "-"


#: (the stages' CPUs, the front's CPU: the API server and the load generator); None: unpinned.
Layout = tuple[set[int], set[int]] | None


class LoggedDeployment(Deployment):
    """omni-up that keeps its processes' logs, so that the report can say how often a router
    ejected a replica under the load (a connect timeout or a liveness probe that fired)."""

    def __init__(
        self, tmp: Path, yaml_text: str, label: str, layout: tuple[set[int], set[int]] | None
    ) -> None:
        super().__init__(tmp, yaml_text, "1:1:1", label)
        self.proc.argv.append("--keep-logs")
        # The API server runs as many requests at once as the slow stage's pool and as many
        # again in transit (docs/operations.md): more would only queue at stage 1, past the
        # API server's max_queue_wait_s.
        self.proc.env["OMNI_STAGE_API_MAX_INFLIGHT"] = str(API_SLOTS)
        self.ejections: list[str] = []
        self.layout = layout

    def __enter__(self) -> LoggedDeployment:
        # omni-up and every process it starts on the stages' CPUs, then the API server moved
        # to the front's CPU (the load generator's): a front door with a core of its own, as
        # an API server deployment has its own CPU request beside the stage pods.
        with pinned(None if self.layout is None else self.layout[0]):
            super().__enter__()
        if self.layout is not None:
            for pid in child_pids(self.proc.pid):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"--api-only" in argv:
                    pin_process(pid, self.layout[1])
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        found = re.search(r"logs\s+(\S+) \(kept\)", self.proc.stdout + self.proc.stderr)
        if found is None:
            return
        logs = Path(found.group(1))
        for log in sorted(logs.glob("*")):
            for line in log.read_text(errors="replace").splitlines():
                if "ejecting instance=" in line:
                    self.ejections.append(line.split("ejecting ", 1)[1][:160])
        shutil.rmtree(logs, ignore_errors=True)


# ---- the report ------------------------------------------------------------------------------


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1000:,.0f}"


def _closed_row(r: Run) -> list[str]:
    ok = r.ok()
    return [
        r.label,
        fmt_num(r.goodput),
        _ms(percentile(ok, 50)),
        _ms(percentile(ok, 99)),
        f"{percentile(ok, 99) / percentile(ok, 50):.2f}" if ok else "-",
        str(len(r.shed())),
        _reasons(r),
        str(r.lost),
    ]


def _at_arrival(r: Run) -> list[float]:
    """The latencies of the sheds answered at arrival (not after waiting in a queue)."""
    return list((Counter(r.shed()) - Counter(r.queue_sheds)).elements())


def _open_row(r: Run, capacity: float) -> list[str]:
    ok, shed = r.ok(), r.shed()
    offered = (len(r.answers) + r.lost) / r.offered_s
    late = r.queue_sheds
    at_once = _at_arrival(r)
    return [
        f"{offered / capacity:.1f}x ({fmt_num(offered)}/s)" + r.label.partition("x")[2],
        fmt_num(r.goodput),
        _ms(percentile(ok, 50)),
        _ms(percentile(ok, 99)),
        str(len(shed)),
        f"{percentile(at_once, 99) * 1000:.1f} / {max(at_once) * 1000:.1f}" if at_once else "-",
        f"{len(late)} (max {max(late) * 1000:,.0f} ms)" if late else "0",
        _reasons(r),
        _gc_cell(r),
        str(r.lost),
    ]


EJECTIONS: list[str] = []


async def _closed_levels(opts: Options, tmp: Path, layout: Layout) -> list[Run]:
    levels = [64, 1000] if opts.quick else [64, 256, 1000, 2000]
    warm, measure = (3.0, 8.0) if opts.quick else (5.0, 15.0)
    runs = []
    dep = LoggedDeployment(tmp, deploy_yaml(QUEUE_WAIT_S), "overload-closed", layout)
    with dep:
        await closed_loop(dep.url, 16, 0.0, 2.0)  # the stages measure their service time
        for clients in levels:
            # Past the first answers of every client: the queues are in their steady state.
            load = closed_loop(dep.url, clients, warm + clients / 150, measure)
            run = await _measured(dep.url, load)
            print(f"[overload] closed {run.label}: {_closed_row(run)}", flush=True)
            runs.append(run)
    EJECTIONS.extend(dep.ejections)
    return runs


async def _open_levels(
    opts: Options,
    tmp: Path,
    capacity: float,
    layout: Layout,
    factors: list[float],
    *,
    gc: str = "",
) -> list[Run]:
    """Open-loop levels on one deployment whose pods pace their GC passes; ``gc="young"``:
    they leave the young passes to CPython's thresholds (``OMNI_STAGE_GC_YOUNG_PASS_S=0``),
    ``gc="all"``: every pass (``OMNI_STAGE_GC_BUSY_PASS_S=0``, which turns off the young
    pacing too)."""
    seconds = 6.0 if opts.quick else 12.0
    runs = []
    dep = LoggedDeployment(tmp, deploy_yaml(OPEN_QUEUE_WAIT_S), f"overload-open{gc}", layout)
    if gc == "young":
        dep.proc.env["OMNI_STAGE_GC_YOUNG_PASS_S"] = "0"
    elif gc == "all":
        dep.proc.env["OMNI_STAGE_GC_BUSY_PASS_S"] = "0"
    suffix = {"": "", "young": ", CPython's young GC", "all": ", CPython's GC"}[gc]
    with dep:
        await closed_loop(dep.url, 16, 0.0, 2.0)
        for f in factors:
            run = await _measured(dep.url, open_level(dep.port, f * capacity, seconds))
            run.label = f"{f:g}x{suffix}"
            row = _open_row(run, capacity)
            print(f"[overload] open {run.label}: {row}; generator: {run.generator}", flush=True)
            runs.append(run)
            await asyncio.sleep(OPEN_QUEUE_WAIT_S + 1)  # the queues drain between levels
    EJECTIONS.extend(dep.ejections)
    return runs


async def _ray(opts: Options, cpus: set[int] | None) -> list[Run]:
    """Ray Serve's /synthetic app at 64 and 2,000 clients, when its venv exists."""
    from benchmarks.peer import RAY_VENV, RayServe

    if opts.quick or not (RAY_VENV / "bin" / "python").exists():
        return []
    ray = RayServe()
    runs = []
    try:
        with pinned(cpus):
            ray.start()
        url = ray.url("synthetic").rsplit("/synthetic", 1)[0]
        for clients in (64, 2000):
            run = await closed_loop(url, clients, 5.0 + clients / 100, 15.0, "/synthetic")
            run.label = f"Ray Serve, {clients} clients"
            runs.append(run)
            print(f"[overload] ray {run.label}: {_closed_row(run)}", flush=True)
    finally:
        ray.stop()
    return runs


async def bench(opts: Options) -> Report:
    report = Report("overload", "overload: goodput, fairness and shedding past capacity")
    tmp = Path(tempfile.mkdtemp(prefix="omni-bench-overload-"))
    # OMNI_BENCH_PIN=0: no pinning (the pipeline may use every CPU, the generator too).
    split = split_cpus() if os.environ.get("OMNI_BENCH_PIN", "1") != "0" else None
    pipe, gen = split if split is not None else (None, None)
    try:
        with pinned(pipe):  # the load generator (this process) beside the stage pods
            closed = await _closed_levels(opts, tmp, split)
            # The most the pipeline delivered in this run: one stall of a shared machine in
            # the 64-client window must not set the open-loop rates.
            capacity = max(r.goodput for r in closed)
            factors = [1.0, 3.0] if opts.quick else [0.5, 1.0, 2.0, 3.0]
            opened = await _open_levels(opts, tmp, capacity, split, factors)
            # The same 3x on pods whose young GC passes are CPython's (gc_young_pass_s 0), and
            # on pods whose every pass is (gc_busy_pass_s 0).
            unpaced = [
                *await _open_levels(opts, tmp, capacity, split, [3.0], gc="young"),
                *await _open_levels(opts, tmp, capacity, split, [3.0], gc="all"),
            ]
            ray = await _ray(opts, None)  # every CPU: Ray's proxy is its front door
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the deploy YAMLs and omni-up's output
    head = ["clients", "ok/s", "p50 ms", "p99 ms", "p99/p50", "shed", "API sheds by reason", "lost"]
    report.add(
        md_table(
            head,
            [_closed_row(r) for r in closed],
            title=f"Closed loop, /v1/generate (stage 1: {STEP_MS:g} ms step, batch {SEQS})",
        )
    )
    report.add(
        md_table(
            [
                "offered",
                "ok/s",
                "p50 ms",
                "p99 ms",
                "shed",
                "shed at arrival p99 / max ms",
                "shed from the queue",
                "API sheds by reason",
                "API GC passes > 10 ms, gen 0 / 1 / 2 (longest)",
                "lost",
            ],
            [_open_row(r, capacity) for r in [*opened, *unpaced]],
            title=f"Open loop (capacity = {fmt_num(capacity)}/s, the best closed-loop goodput; "
            f"max_queue_wait_s {OPEN_QUEUE_WAIT_S:g})",
        )
    )
    if ray:
        report.add(md_table(head, [_closed_row(r) for r in ray], title="Ray Serve (/synthetic)"))
    else:
        report.notes.append(
            "Ray Serve at 2,000 clients: not run (quick mode, or no benchmarks/.ray-venv: "
            "`python -m benchmarks peer` creates it)."
        )
    _targets(report, closed, opened, capacity)
    if EJECTIONS:
        report.notes.append(
            f"Replicas ejected by a router during the runs: {len(EJECTIONS)} (a connect "
            "timeout or liveness probe that fired on a loaded, live pod stalls its hops for "
            f"the ejection time), e.g. {EJECTIONS[0]}"
        )
    report.notes.append(_pinning_note(pipe, gen))
    slow = [(r.label, max(a)) for r in opened if (a := _at_arrival(r)) and max(a) > 0.010]
    if slow:
        report.notes.append(
            "Sheds at arrival answered past 10 ms ("
            + ", ".join(f"{label}: max {top * 1000:.1f} ms" for label, top in slow)
            + "): the API server answers a shed on its headers in well under a millisecond of "
            "CPU, so the rest is its event loop running late. Its full GC passes are paced "
            "(sidecar/gc_pacer.py: at idle moments, or once per 60 s busy, survivors frozen), "
            "so none ran inside a level, and so are its young passes (every 0.1 s while it "
            "holds work); the API GC column shows the passes that still took longer than 10 ms."
        )
    report.notes.append(
        "The last two open-loop rows are the same 3x load, in the same run, on a deployment "
        "started with OMNI_STAGE_GC_YOUNG_PASS_S=0 (every pod paces its full GC passes but "
        "leaves the young ones to CPython's thresholds), and on one started with "
        "OMNI_STAGE_GC_BUSY_PASS_S=0 (every pass left to CPython): the pacer's effect on the "
        "sheds, young passes and full ones apart."
    )
    for r in [*opened, *unpaced]:
        report.notes.append(f"Open-loop generator at {r.label}: {r.generator}.")
    if not opts.quick:
        plot(closed, opened, capacity, report, stage1=f"{STEP_MS:g} ms x {SEQS}")
    return report


def _pinning_note(pipe: set[int] | None, gen: set[int] | None) -> str:
    if pipe is None or gen is None:
        return (
            "No CPU pinning (OMNI_BENCH_PIN=0, or one CPU): the load generator shares the CPUs "
            "with the pipeline; its own cost and lateness are in the notes below."
        )
    return (
        f"CPU pinning (os.sched_setaffinity): the API server alone on CPU "
        f"{','.join(map(str, sorted(gen)))} (a deployment gives its API servers a CPU request "
        "of their own beside the stage pods); the stage pods, omni-up, the control plane "
        f"and the load generator (this process) on CPU {','.join(map(str, sorted(pipe)))}; Ray "
        "Serve unpinned (every CPU, beside the load generator); "
        "capacity (the best closed-loop goodput) is "
        "measured under the same pinning, so the open-loop ratios hold. The open loop sends "
        "prebuilt requests over keep-alive connections opened beforehand "
        "(benchmarks/openloop.py) and measures latency from each request's scheduled send "
        "time (no coordinated omission); its requests carry X-Omni-Priority: normal, as a "
        "gateway in front would set it, so that the API server can shed them on their "
        "headers (docs/operations.md, Under overload)."
    )


def _targets(report: Report, closed: list[Run], opened: list[Run], capacity: float) -> None:
    by_clients = {r.label: r for r in closed}
    top = closed[-1]
    report.targets.append(
        Target(
            f"goodput at {top.label} / at 64 clients",
            top.goodput / closed[0].goodput,
            0.9,
            True,
            "x",
        )
    )
    for r in closed:
        ok = r.ok()
        report.targets.append(
            Target(
                f"p99/p50 at {r.label}", percentile(ok, 99) / percentile(ok, 50), 1.5, False, "x"
            )
        )
    three = opened[-1]
    report.targets.append(
        Target("open loop 3x: goodput / capacity", three.goodput / capacity, 0.9, True, "x")
    )
    shed = three.shed()
    report.targets.append(
        Target(
            "open loop 3x: slowest shed answer",
            max(shed) * 1000 if shed else math.nan,
            10.0,
            False,
            "ms",
            fmt=lambda v: f"{v:.1f}",
        )
    )
    late = Counter(three.queue_sheds)
    at_once = list((Counter(shed) - late).elements())
    report.targets.append(
        Target(
            "open loop 3x: slowest shed at arrival (not after queueing)",
            max(at_once) * 1000 if at_once else math.nan,
            10.0,
            False,
            "ms",
            fmt=lambda v: f"{v:.1f}",
        )
    )
    service = percentile(by_clients["64 clients"].ok(), 50)
    report.targets.append(
        Target(
            "open loop 3x: admitted p99",
            percentile(three.ok(), 99),
            OPEN_QUEUE_WAIT_S + service,
            False,
            "s",
        )
    )
    lost = sum(r.lost for r in [*closed, *opened])
    report.targets.append(
        Target("requests lost (all levels)", lost, 0, False, "", fmt=lambda v: f"{v:.0f}")
    )
    for r in [*closed, *opened]:
        if r.lost_samples:
            report.notes.append(f"lost at {r.label}: {'; '.join(r.lost_samples)}")
