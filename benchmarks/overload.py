"""overload — goodput, fairness and shedding past capacity, through ``omni-up``.

The synthetic pipeline with a slow middle stage (issue 13's set-up): stage 1 steps every
20 ms with batches of 8 (capacity about 400 requests/s), stages 0 and 2 fast. Clients call
``POST /v1/generate`` on omni-up's API server.

* **Closed loop** at 64, 256, 1,000 and 2,000 clients (each sends, waits for the answer, sends
  again): goodput (200s per second), p50 and p99 latency, sheds and lost requests. The
  admission queues hold the excess in FIFO order, so p99 should stay near p50 and goodput at
  capacity.
* **Open loop** at 0.5x, 1x, 2x and 3x the measured capacity (the best closed-loop goodput),
  arrivals at a fixed rate whatever the answers do, with ``max_queue_wait_s`` short (2 s):
  goodput, how fast a shed request is answered (503 + Retry-After), the admitted p99.
* **Ray Serve** at 2,000 clients (its ``/synthetic`` app from :mod:`benchmarks.ray_app`, run by
  ``benchmarks/.ray-venv``) when that venv exists; its own 64-client figure is the baseline.

A request is *lost* if it gets no answer or an answer other than 200 and a shed 503/429.
``--quick`` runs 64 and 1,000 clients and 1x/3x open loop, shorter. A PNG of latency against
load goes to ``docs/overload.png`` (matplotlib: the ``bench`` extra), full runs only.
"""

from __future__ import annotations

import asyncio
import math
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.autoscale_run import Deployment
from benchmarks.common import ROOT, Options, Report
from benchmarks.measure import Target, fmt_num, md_table, percentile

STEP_MS = 20.0
SEQS = 8
QUEUE_WAIT_S = 30.0  # closed loop: nothing should wait this long
OPEN_QUEUE_WAIT_S = 2.0  # open loop: past 2 s of queue a request is shed at arrival
TIMEOUT_S = 60
MAX_OPEN = 6000  # open loop: outstanding requests beyond this are counted lost (never sent)

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


@dataclass
class Run:
    """One load level: every answer's (send time, latency, status), times from the start of
    the window; the figures count the answers that arrived inside the window."""

    label: str
    window_s: float = 0.0
    answers: list[tuple[float, float, int]] = field(default_factory=list)
    lost: int = 0
    lost_samples: list[str] = field(default_factory=list)
    offered_s: float = 0.0  # open loop: how long arrivals were sent (every answer counts)
    reasons: dict[str, float] = field(default_factory=dict)  # the API server's sheds by reason

    def _in_window(self, statuses: tuple[int, ...]) -> list[float]:
        end = self.window_s
        return [lat for t, lat, st in self.answers if st in statuses and 0 <= t + lat <= end]

    def ok(self) -> list[float]:
        return self._in_window((200,))

    def shed(self) -> list[float]:
        return self._in_window((429, 503))

    @property
    def goodput(self) -> float:
        """200s per second of the window (open loop: from the first arrival to the last
        answer, so that a backlog drained after the arrivals stopped is not counted faster)."""
        return len(self.ok()) / self.seconds if self.seconds else math.nan

    @property
    def seconds(self) -> float:
        if not self.offered_s:
            return self.window_s
        return max([self.offered_s, *(t + lat for t, lat, _ in self.answers)])

    def lose(self, why: str) -> None:
        self.lost += 1
        if len(self.lost_samples) < 3:
            self.lost_samples.append(why[:200])


async def _one(sess: aiohttp.ClientSession, url: str, i: int, run: Run, t_start: float) -> None:
    t0 = time.monotonic()
    try:
        async with sess.post(url, json={"prompt": "x", "seed": i}) as resp:
            body = await resp.read()
            status = resp.status
    except Exception as exc:  # every failure is counted as lost
        run.lose(f"{type(exc).__name__}: {exc}")
        return
    if status == 200 or (status in (429, 503) and b'"shed"' in body):
        run.answers.append((t0 - t_start, time.monotonic() - t0, status))
    else:
        run.lose(f"HTTP {status}: {body[:150]!r}")


def _session(n: int) -> aiohttp.ClientSession:
    conn = aiohttp.TCPConnector(limit=n, limit_per_host=n)
    return aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S + 30)
    )


async def closed_loop(
    url: str, clients: int, warmup_s: float, measure_s: float, path: str = "/v1/generate"
) -> Run:
    """``clients`` workers, each sending its next request when its last one was answered,
    until the window closes; the figures are those of the answers inside the window."""
    run = Run(f"{clients} clients", window_s=measure_s)
    measure_from = time.monotonic() + warmup_s
    stop_at = measure_from + measure_s
    counter = iter(range(1 << 62))
    async with _session(clients) as sess:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                await _one(sess, url + path, next(counter), run, measure_from)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return run


async def open_loop(url: str, rps: float, seconds: float) -> Run:
    """Arrivals every 1/rps seconds for ``seconds``; every answer awaited."""
    run = Run(f"{rps:.0f}/s", window_s=seconds + TIMEOUT_S)
    n = int(rps * seconds)
    t_start = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()
    async with _session(MAX_OPEN) as sess:
        for i in range(n):
            delay = t_start + i / rps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= MAX_OPEN:
                run.lose("client: too many outstanding requests")
                continue
            task = asyncio.create_task(_one(sess, url + "/v1/generate", i, run, t_start))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    run.offered_s = seconds
    return run


async def shed_reasons(url: str) -> dict[str, float]:
    """The API server's ``omni_stage_shed_total`` by reason (where the queue forms)."""
    async with aiohttp.ClientSession() as sess, sess.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("omni_stage_shed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _measured(url: str, load: Awaitable[Run]) -> Run:
    before = await shed_reasons(url)
    run = await load
    after = await shed_reasons(url)
    run.reasons = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    return run


def _reasons(r: Run) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.reasons.items())) or "-"


class LoggedDeployment(Deployment):
    """omni-up that keeps its processes' logs, so that the report can say how often a router
    ejected a replica under the load (a connect timeout or a liveness probe that fired)."""

    def __init__(self, tmp: Path, yaml_text: str, label: str) -> None:
        super().__init__(tmp, yaml_text, "1:1:1", label)
        self.proc.argv.append("--keep-logs")
        self.ejections: list[str] = []

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


def _open_row(r: Run, capacity: float) -> list[str]:
    ok, shed = r.ok(), r.shed()
    offered = (len(r.answers) + r.lost) / r.offered_s
    return [
        f"{offered / capacity:.1f}x ({fmt_num(offered)}/s)",
        fmt_num(r.goodput),
        _ms(percentile(ok, 50)),
        _ms(percentile(ok, 99)),
        str(len(shed)),
        f"{percentile(shed, 99) * 1000:.1f}" if shed else "-",
        f"{max(shed) * 1000:.1f}" if shed else "-",
        _reasons(r),
        str(r.lost),
    ]


EJECTIONS: list[str] = []


async def _closed_levels(opts: Options, tmp: Path) -> list[Run]:
    levels = [64, 1000] if opts.quick else [64, 256, 1000, 2000]
    warm, measure = (3.0, 8.0) if opts.quick else (5.0, 15.0)
    runs = []
    dep = LoggedDeployment(tmp, deploy_yaml(QUEUE_WAIT_S), "overload-closed")
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


async def _open_levels(opts: Options, tmp: Path, capacity: float) -> list[Run]:
    factors = [1.0, 3.0] if opts.quick else [0.5, 1.0, 2.0, 3.0]
    seconds = 6.0 if opts.quick else 12.0
    runs = []
    dep = LoggedDeployment(tmp, deploy_yaml(OPEN_QUEUE_WAIT_S), "overload-open")
    with dep:
        await closed_loop(dep.url, 16, 0.0, 2.0)
        for f in factors:
            run = await _measured(dep.url, open_loop(dep.url, f * capacity, seconds))
            run.label = f"{f:g}x"
            print(f"[overload] open {run.label}: {_open_row(run, capacity)}", flush=True)
            runs.append(run)
            await asyncio.sleep(OPEN_QUEUE_WAIT_S + 1)  # the queues drain between levels
    EJECTIONS.extend(dep.ejections)
    return runs


async def _ray(opts: Options) -> list[Run]:
    """Ray Serve's /synthetic app at 64 and 2,000 clients, when its venv exists."""
    from benchmarks.peer import RAY_VENV, RayServe

    if opts.quick or not (RAY_VENV / "bin" / "python").exists():
        return []
    ray = RayServe()
    runs = []
    try:
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
    closed = await _closed_levels(opts, tmp)
    # The most the pipeline delivered in this run: one stall of a shared machine in the
    # 64-client window must not set the open-loop rates.
    capacity = max(r.goodput for r in closed)
    opened = await _open_levels(opts, tmp, capacity)
    ray = await _ray(opts)
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
                "shed p99 ms",
                "shed max ms",
                "API sheds by reason",
                "lost",
            ],
            [_open_row(r, capacity) for r in opened],
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
    report.notes.append(
        "The load generator runs on the same 2-core machine as every process of the pipeline "
        "(and, here, beside other people's test runs): at 1,000+ clients it takes a large share "
        "of the CPU, so absolute figures are lower than the stages alone could do."
    )
    if not opts.quick:
        _plot(closed, opened, capacity, report)
    return report


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


def _plot(closed: list[Run], opened: list[Run], capacity: float, report: Report) -> None:
    try:
        import matplotlib
    except ImportError:
        report.notes.append("No plot: matplotlib is not installed (`pip install -e '.[bench]'`).")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_o) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [int(r.label.split()[0]) for r in closed]
    for q, style in ((50, "o-"), (99, "s--")):
        ax_c.plot(xs, [percentile(r.ok(), q) for r in closed], style, label=f"p{q}")
    ax_c.set_xscale("log")
    ax_c.set_xlabel("closed-loop clients")
    ax_c.set_ylabel("latency (s)")
    ax_c2 = ax_c.twinx()
    ax_c2.plot(xs, [r.goodput for r in closed], "k:", label="ok/s")
    ax_c2.set_ylabel("goodput (ok/s)")
    ax_c2.set_ylim(0, capacity * 1.3)
    ax_c.legend(loc="upper left")
    factors = [float(r.label.rstrip("x")) for r in opened]
    ax_o.plot(factors, [r.goodput for r in opened], "o-", label="ok/s")
    ax_o.plot(factors, [len(r.shed()) / r.seconds for r in opened], "s--", label="shed/s")
    ax_o.axhline(capacity, color="gray", linestyle=":", label="capacity")
    ax_o.set_xlabel("offered load (x capacity)")
    ax_o.set_ylabel("requests/s")
    ax_o.legend(loc="upper left")
    fig.suptitle("omni-mesh under overload: synthetic pipeline, stage 1 at 20 ms x 8")
    fig.tight_layout()
    out = ROOT / "docs" / "overload.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    report.add("![latency and goodput under overload](overload.png)\n")
