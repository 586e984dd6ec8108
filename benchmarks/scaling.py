"""scaling — a 3-stage synthetic pipeline whose middle stage is the bottleneck (50 ms per step
at batch 1, simulating accelerator time without burning CPU) at 1:1:1, 1:2:1, 1:4:1 and 1:8:1.

Stages 0 and 2 are no-op; stage 1 runs ``--stage-overrides {"1": {"step_latency_ms": 50,
"max_num_seqs": 1}}``, so one replica completes at most 20 requests/s and N replicas at most
20·N. The client drives ``/v1/hop`` of stage 0 with a closed loop of 8 workers per middle
replica (enough to keep every replica's queue non-empty). Replicas are added to the running
topology (1 → 2 → 4 → 8); each level is measured once the control plane lists them all, after
a warm-up. Scaling efficiency = throughput ÷ (N x the 1:1:1 throughput).
"""

from __future__ import annotations

import asyncio
from statistics import median

from benchmarks.common import Options, Report, hop_caller
from benchmarks.fabric import Fabric
from benchmarks.load import LoadResult, run_load
from benchmarks.measure import RssReport, Target, fmt_ms, fmt_num, md_table

LEVELS = (1, 2, 4, 8)
STEP_MS = 50.0
WORKERS_PER_REPLICA = 8


async def bench(opts: Options) -> Report:
    report = Report("scaling", "scaling: 1:N:1 with a 50 ms (batch 1) middle stage")
    reps = opts.repetitions(3, 2)
    window = opts.pickf(10.0, 2.5)
    warmup = opts.pickf(2.0, 0.8)
    rss = RssReport()
    results: dict[int, list[LoadResult]] = {}
    overrides = {"1": {"step_latency_ms": STEP_MS, "per_item_latency_ms": 0, "max_num_seqs": 1}}
    with Fabric("scaling", stage_overrides=overrides) as fab:
        fab.start_cp()
        s0 = fab.add_stage(0, wait=False)
        fab.add_stage(1, wait=False)
        fab.add_stage(2, wait=False)
        fab.wait_ready()
        for s in (0, 1, 2):
            fab.wait_discovered(s, 1)
        await asyncio.sleep(0.5)
        rss.idle = fab.processes().rss()
        for n in LEVELS:
            have = len(fab.stage_pods(1))
            new = [fab.add_stage(1, wait=False) for _ in range(n - have)]
            fab.wait_ready(new)
            fab.wait_discovered(1, n)
            await asyncio.sleep(0.3)  # the watch pushes the new pool to stage 0 at once
            fn = hop_caller(s0.url, 0, f"n{n}")
            conc = WORKERS_PER_REPLICA * n
            for _rep in range(reps):
                res = await run_load(fn, concurrency=conc, duration_s=window, warmup_s=warmup)
                res.check(f"scaling 1:{n}:1")
                results.setdefault(n, []).append(res)
            print(f"[scaling] 1:{n}:1 done", flush=True)
        rss.loaded = fab.processes().rss()
    base = median(r.throughput for r in results[1])
    rows = []
    worst = 1.0
    for n in LEVELS:
        thr = median(r.throughput for r in results[n])
        eff = thr / (n * base)
        worst = min(worst, eff)
        rows.append(
            [
                f"1:{n}:1",
                str(WORKERS_PER_REPLICA * n),
                fmt_num(thr, 1),
                fmt_num(n * 1000.0 / STEP_MS, 0),
                fmt_ms(median(r.p(50) for r in results[n]), 1),
                fmt_ms(median(r.p(99) for r in results[n]), 1),
                f"{eff:.3f}",
            ]
        )
    report.add(
        md_table(
            [
                "replicas",
                "concurrency",
                "req/s",
                "ideal req/s (20*N)",
                "p50 ms",
                "p99 ms",
                "scaling efficiency",
            ],
            rows,
            title="Throughput with a 50 ms/step middle stage",
            notes=(
                f"Median of {reps} windows of {window:g} s per level (after {warmup:g} s warm-up). "
                "Efficiency = req/s / (N x req/s at 1:1:1); latency is mostly queueing "
                f"({WORKERS_PER_REPLICA} requests per 50 ms replica)."
            ),
        )
    )
    report.add(rss.table())
    report.targets.append(
        Target("scaling efficiency up to 1:8:1 (worst level)", worst, 0.9, True, "", _f3)
    )
    return report


def _f3(v: float) -> str:
    return f"{v:.3f}"
