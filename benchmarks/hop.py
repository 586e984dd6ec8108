"""hop — what one hop costs: end-to-end latency and throughput of 1-, 2- and 3-stage chains of
no-op synthetic stages, beside a raw aiohttp loopback round trip measured in the same run.

Topology: omni-cp (embedded Redis), one pod each of stages 0, 1 and 2 of the registered
``synthetic`` pipeline (no-op: 0 ms, 64-byte output, ``shm`` edges), an ``--api-only`` API
server, and a bare aiohttp echo server (``benchmarks/echo_server.py``).

The k-stage chain is the last k stages of that one pipeline: the client POSTs a msgpack
``StageInput`` to ``/v1/hop`` of stage 3-k, which runs its engine and hands the request on
through the real hop path until stage 2 answers. Stage processes only know pipelines that are
importable at their start, so the chains are not re-registered pipelines; this way every chain
runs the production code path, and a k-stage chain is exactly k HTTP round trips (client →
first stage, then k-1 sidecar → sidecar hops) plus k engine executions.
"""

from __future__ import annotations

import asyncio
import math
import sys
from dataclasses import dataclass, field
from statistics import median

from benchmarks.common import (
    HOP_HEADERS,
    Options,
    Report,
    generate_caller,
    hop_caller,
    hop_input,
    post_caller,
)
from benchmarks.fabric import Fabric
from benchmarks.load import LoadResult, RequestFn, new_session, run_load
from benchmarks.measure import (
    CpuMeter,
    RssReport,
    Target,
    fmt_ms,
    fmt_num,
    fmt_us,
    md_table,
    ratio,
)
from benchmarks.profiling import Profiler
from omni_mesh.data_plane import codec
from tests.procs import LOCALHOST, ManagedProcess, clean_env, free_port


@dataclass
class Route:
    """One measured path (the raw baseline, a k-stage chain, or the API route)."""

    key: str
    label: str
    stages: int  # engine executions
    round_trips: int  # HTTP round trips on the request's path
    fn: RequestFn
    cpu_pids: list[int]
    c1: list[LoadResult] = field(default_factory=list)
    c64: list[LoadResult] = field(default_factory=list)
    cpu_per_req: list[float] = field(default_factory=list)  # fabric CPU s per request (c64)
    cpu_per_req_c1: list[float] = field(default_factory=list)  # the same at c=1
    client_cpu_per_req: list[float] = field(default_factory=list)

    def med(self, runs: list[LoadResult], q: float) -> float:
        return median(r.p(q) for r in runs) if runs else math.nan

    def thr(self) -> float:
        return median(r.throughput for r in self.c64) if self.c64 else math.nan


async def bench(opts: Options) -> Report:
    report = Report("hop", "hop: fabric cost per hop vs a raw aiohttp loopback round trip")
    reps = opts.repetitions()
    n_c1 = opts.pick(1000, 150)
    dur_c64 = opts.pickf(5.0, 1.2)
    warm_c64 = opts.pickf(1.0, 0.3)
    rss = RssReport()
    with Fabric("hop") as fab:
        fab.start_cp()
        stages = [fab.add_stage(s, wait=False) for s in (0, 1, 2)]
        api = fab.add_stage(0, api_only=True, wait=False)
        fab.wait_ready()
        for s in (0, 1, 2):
            fab.wait_discovered(s, 1)
        echo_port = free_port()
        echo = ManagedProcess(
            _echo_argv(echo_port),
            name="echo",
            env=clean_env(),
            log_dir=fab.log_dir,
        ).start()
        try:
            echo.wait_http_ready(f"http://{LOCALHOST}:{echo_port}/health", 20)
            await asyncio.sleep(1.0)
            procs = fab.processes()
            rss.idle = procs.rss()
            fabric_pids = procs.pids(["sidecar", "engine"])
            # The echo server answers as many bytes as a 3-stage hop answer, and gets a
            # 3-stage hop body: the same bytes on the wire as one real hop.
            sample = await _one_hop_size(stages[0].url)
            echo.terminate()
            echo = ManagedProcess(
                [*_echo_argv(echo_port), "--response-bytes", str(sample)],
                name="echo2",
                env=clean_env(),
                log_dir=fab.log_dir,
            ).start()
            echo.wait_http_ready(f"http://{LOCALHOST}:{echo_port}/health", 20)
            body = codec.encode(hop_input(0, "raw-0", 0))
            paths = [
                Route(
                    "raw",
                    "raw aiohttp loopback round trip",
                    0,
                    1,
                    post_caller(f"http://{LOCALHOST}:{echo_port}/echo", body),
                    [echo.pid],
                ),
            ]
            for k in (1, 2, 3):
                first = stages[3 - k]
                paths.append(
                    Route(
                        f"k{k}",
                        f"{k}-stage chain (POST /v1/hop to stage {3 - k})",
                        k,
                        k,
                        hop_caller(first.url, 3 - k, f"k{k}"),
                        fabric_pids,
                    )
                )
            paths.append(
                Route(
                    "api",
                    "3-stage via API server (POST /v1/generate, JSON)",
                    3,
                    4,
                    generate_caller(api.url),
                    [*fabric_pids, api.pid],
                )
            )
            for p in paths:  # warm-up: connections, arenas, caches
                await run_load(p.fn, concurrency=8, requests=opts.pick(300, 100), warmup_s=0.2)
            for rep in range(reps):
                for p in paths:
                    await _measure(p, rep, n_c1, dur_c64, warm_c64)
                print(f"[hop] repetition {rep + 1}/{reps} done", flush=True)
            rss.loaded = fab.processes().rss()
            if opts.profile_dir is not None:
                await _profile(opts, fab, paths[3], report)
        finally:
            echo.terminate()
    _tables(report, paths, rss, reps, n_c1, dur_c64)
    return report


def _echo_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.echo_server", "--port", str(port)]


async def _one_hop_size(url: str) -> int:
    async with new_session(1) as sess:
        body = codec.encode(hop_input(0, "size-probe", 1))
        async with sess.post(url + "/v1/hop", data=body, headers=HOP_HEADERS) as resp:
            return len(await resp.read())


async def _measure(p: Route, rep: int, n_c1: int, dur_c64: float, warm_c64: float) -> None:
    meter1 = CpuMeter({"fabric": p.cpu_pids})

    def window1(opening: bool) -> None:
        (meter1.start if opening else meter1.stop)()

    res = await run_load(p.fn, concurrency=1, requests=n_c1, warmup_s=0.05, on_window=window1)
    res.check(f"{p.key} c=1")
    p.c1.append(res)
    p.cpu_per_req_c1.append(meter1.used["fabric"] / max(1, res.completed))
    meter = CpuMeter({"fabric": p.cpu_pids})

    def window(opening: bool) -> None:
        (meter.start if opening else meter.stop)()

    res = await run_load(
        p.fn, concurrency=64, duration_s=dur_c64, warmup_s=warm_c64, on_window=window
    )
    res.check(f"{p.key} c=64")
    p.c64.append(res)
    p.cpu_per_req.append(meter.used["fabric"] / max(1, res.completed))
    p.client_cpu_per_req.append(meter.used["client"] / max(1, res.completed))


async def _profile(opts: Options, fab: Fabric, p: Route, report: Report) -> None:
    assert opts.profile_dir is not None
    targets = {}
    for pod in fab.stage_pods(0) + fab.stage_pods(1) + fab.stage_pods(2):
        targets[f"hop-sidecar-s{pod.stage_id}"] = pod.pid
        engine = pod.engine_pid()
        if engine is not None:
            targets[f"hop-engine-s{pod.stage_id}"] = engine
    seconds = 5.0
    for conc in (1, 64):
        named = {f"{label}-c{conc}": pid for label, pid in targets.items()}
        prof = Profiler(named, opts.profile_dir, seconds)
        if not prof.start():
            report.notes.append("py-spy not installed: no profile taken")
            return
        await run_load(p.fn, concurrency=conc, duration_s=seconds + 1, warmup_s=0.2)
        prof.wait()
        report.add(prof.summaries())


def _tables(
    report: Report, paths: list[Route], rss: RssReport, reps: int, n_c1: int, dur: float
) -> None:
    raw = paths[0]
    raw_p50 = raw.med(raw.c1, 50)
    rows = []
    for p in paths:
        rows.append(
            [
                p.label,
                str(p.round_trips),
                fmt_ms(p.med(p.c1, 50), 3),
                fmt_ms(p.med(p.c1, 99), 3),
                fmt_ms(p.med(p.c64, 50), 2),
                fmt_ms(p.med(p.c64, 99), 2),
                fmt_num(p.thr()),
                fmt_num(median(p.cpu_per_req_c1) * 1e6) if p.cpu_per_req_c1 else "-",
                fmt_num(median(p.cpu_per_req) * 1e6) if p.cpu_per_req else "-",
            ]
        )
    report.add(
        md_table(
            [
                "path",
                "HTTP round trips",
                "p50 ms (c=1)",
                "p99 ms (c=1)",
                "p50 ms (c=64)",
                "p99 ms (c=64)",
                "req/s (c=64)",
                "server CPU µs/req (c=1)",
                "server CPU µs/req (c=64)",
            ],
            rows,
            title="Latency and throughput",
            notes=(
                f"Median of {reps} runs; each run is {n_c1} sequential requests at c=1 and a "
                f"{dur:g} s window of a closed loop with 64 workers at c=64. 'server CPU' is "
                "user+system time of every sidecar and engine process (the echo server for the "
                "raw row; the API server too for /v1/generate) over the run, per request."
            ),
        )
    )
    over_rows = []
    per_hop: dict[int, float] = {}
    for p in paths[1:4]:
        k = p.stages
        lat = p.med(p.c1, 50)
        over = (lat - k * raw_p50) / k
        per_hop[k] = over
        cpu_hop = median(p.cpu_per_req) / k if p.cpu_per_req else math.nan
        raw_cpu = median(raw.cpu_per_req) if raw.cpu_per_req else math.nan
        over_rows.append(
            [
                f"{k}-stage",
                fmt_ms(lat, 3),
                fmt_ms(k * raw_p50, 3),
                fmt_us(over),
                fmt_us(cpu_hop),
                fmt_num(ratio(cpu_hop, raw_cpu), 1) + "x",
            ]
        )
    k3 = paths[3]
    slope = (k3.med(k3.c1, 50) - paths[1].med(paths[1].c1, 50)) / 2 - raw_p50
    report.add(
        md_table(
            [
                "chain",
                "p50 ms (c=1)",
                "k x raw round trip ms",
                "fabric overhead per hop µs (p50)",
                "fabric CPU µs per request per hop",
                "vs raw server CPU per round trip",
            ],
            over_rows,
            title="Fabric overhead per hop",
            notes=(
                "overhead per hop = (p50 of the k-stage chain - k x p50 of the raw round trip) "
                "/ k: everything the fabric adds to moving a request across one hop and "
                "through one (no-op) engine — sidecar routing, msgpack, admission, the "
                "sidecar ⇄ engine channel and the engine loop. Marginal cost of one more hop "
                f"((3-stage - 1-stage)/2 - raw): {fmt_us(slope)} µs. CPU per hop: sidecar + "
                "engine CPU per request at c=64 divided by k."
            ),
        )
    )
    report.add(rss.table())
    sidecar_idle = max(rss.idle.get("sidecar", [0]) or [0])
    report.targets += [
        Target(
            "fabric overhead per hop, p50 at c=1 (3-stage)",
            per_hop.get(3, math.nan) * 1e3,
            0.35,  # issue 20 (0.5 before it)
            False,
            "ms",
            lambda v: f"{v:.3f}",
        ),
        Target(
            "sidecar RSS idle (max)", sidecar_idle / 2**20, 150, False, "MB", lambda v: f"{v:.0f}"
        ),
    ]


def _mb(v: float) -> str:
    return f"{v:.0f}"
