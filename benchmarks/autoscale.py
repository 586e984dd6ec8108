"""autoscale — per-stage autoscaling under ``omni-up``: the synthetic pipeline with a slow stage 1
(a 200 ms engine step, 2 requests per step and per replica: one replica carries at most
10 requests/s), an open-loop load of ``/v1/generate`` that steps from 3 to 16 requests/s (what
one replica cannot carry) and then follows a square wave between the two whose low phase is
twice as long as its high one.

The same load runs three times: with stage 1 autoscaled (``min_replicas: 1``,
``max_replicas: 4``, target utilization 0.6), the same with one warm standby replica
(``standby_replicas: 1``: promoted at once when the pool needs a replica, replaced in the
background), and against a static pool at the maximum (4). Figures: the time from the step
until the p99 latency (of the requests sent in the last 2 s) is back under the target for
good, failed requests (non-200 answers, and arrivals the generator had to drop with
``MAX_OUTSTANDING`` requests already waiting), replica-seconds of stage 1 (its processes,
sampled every 0.25 s: starting, standby and draining ones count) and goodput (requests
answered 200 within the latency target, per second).

Last, the cold start of a stage at zero (``min_replicas: 0``), without and with a standby: a
request that finds stage 1 with no serving replica waits while the hop client wakes it and
omni-up starts one (or the control plane promotes the standby); its latency against the same
request with a replica serving. A PNG of load, replicas and p99 over time goes to
``docs/autoscale.png`` (matplotlib: the ``bench`` extra). ``--quick`` runs a shorter profile
and no static run (no PNG).

This module builds the report from the runs' traces; running one deployment under the load is
:mod:`benchmarks.autoscale_run`.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import aiohttp

from benchmarks.autoscale_run import (
    AUTOSCALE,
    MAX_REPLICAS,
    MIN_REPLICAS,
    RECOVERY_BOUND_S,
    SAMPLE_S,
    SEQS,
    STANDBY,
    STEP_MS,
    TARGET_P99_S,
    WINDOW_S,
    cold_start,
    deploy_yaml,
    run,
)
from benchmarks.common import ROOT, Options, Report
from benchmarks.measure import Target, fmt_num, md_table, percentile


async def bench(opts: Options) -> Report:
    report = Report("autoscale", "Autoscaling: a slow stage 1 under a step and a square wave")
    down = opts.pickf(4, 3)
    policy = AUTOSCALE.format(min=MIN_REPLICAS, max=MAX_REPLICAS, down_window=down, standby=0)
    spare = AUTOSCALE.format(min=MIN_REPLICAS, max=MAX_REPLICAS, down_window=down, standby=STANDBY)
    with tempfile.TemporaryDirectory(prefix="omni-bench-autoscale-") as tmp_name:
        tmp = Path(tmp_name)
        traces = [await run(tmp, "autoscaled", deploy_yaml(start=1, autoscale=policy), 1, opts)]
        label = f"autoscaled + {STANDBY} standby"
        traces.append(await run(tmp, label, deploy_yaml(start=1, autoscale=spare), 1, opts))
        if not opts.quick:
            n = MAX_REPLICAS
            traces.append(await run(tmp, f"static {n}", deploy_yaml(start=n), n, opts))
        colds: dict[int, tuple[list[float], list[float]]] = {}
        for standby in (0, STANDBY):
            try:
                colds[standby] = await cold_start(tmp, opts.repetitions(3, 1), standby)
            except (RuntimeError, AssertionError, aiohttp.ClientError) as exc:
                report.notes.append(f"Cold start from zero (standby {standby}) not measured: {exc}")
    auto, spared = traces[0], traces[1]
    step_t = auto.phase_start("step")
    wave_t = auto.phase_start("wave-low-0")
    end = auto.duration
    rows = []
    for tr in traces:
        rows.append(
            [
                tr.label,
                f"{tr.recovery_s(step_t, wave_t):.1f} s",
                str(tr.failed()),
                fmt_num(tr.replica_seconds(0, end)),
                fmt_num(tr.replica_seconds(wave_t, end)),
                f"{tr.goodput(0, end):.1f}",
                f"{tr.goodput(wave_t, end):.1f}",
            ]
        )
    static_max = MAX_REPLICAS * (end - wave_t)
    rows.append(
        [
            f"static {MAX_REPLICAS} (computed)",
            "",
            "",
            fmt_num(MAX_REPLICAS * end),
            fmt_num(static_max),
            "",
            "",
        ]
    )
    phases = ", ".join(f"{p.name} {p.seconds:g} s at {p.rps:g}/s" for p in auto.phases)
    report.add(
        md_table(
            [
                "deployment",
                "step → p99 under target",
                "failed",
                "replica-s (all)",
                "replica-s (wave)",
                "goodput/s (all)",
                "goodput/s (wave)",
            ],
            rows,
            title=f"Step load then square wave (stage 1: {STEP_MS:g} ms steps of {SEQS})",
            notes=f"Load (open loop, `/v1/generate`): {phases}. Latency target (p99, requests "
            f"sent in the last {WINDOW_S:g} s): {TARGET_P99_S:g} s. Goodput: requests answered 200 "
            f"within the target per second. Replica-seconds: stage-1 processes sampled every "
            f"{SAMPLE_S:g} s (starting and draining ones count).",
        )
    )
    first_up = min((t - step_t for t in auto.scale_ups if t >= step_t), default=math.nan)
    startups = auto.startups or [math.nan]
    report.add(
        md_table(
            ["after the step (autoscaled)", "seconds"],
            [
                ["first replica started (window, heartbeat, sweep, actuator poll)",
                 f"{first_up:.1f}"],
                [f"replica start to ready, median of {len(auto.startups)}",
                 f"{percentile(startups, 50):.1f}"],
                ["replica start to ready, max", f"{max(startups):.1f}"],
                ["p99 back under the target", f"{auto.recovery_s(step_t, wave_t):.1f}"],
            ],
            title="Where the time to recover goes",
        )
    )  # fmt: skip
    cold_rows = []
    for standby, (cold, warm) in sorted(colds.items()):
        first = (
            "first request (wake, start, READY)"
            if not standby
            else f"first request, {standby} standby warm (wake, promotion)"
        )
        cold_rows += [
            [first, f"{percentile(cold, 50):.2f} s", f"{max(cold):.2f} s", str(len(cold))],
            ["the next one (a replica serving)", f"{percentile(warm, 50):.3f} s",
             f"{max(warm):.3f} s", str(len(warm))],
        ]  # fmt: skip
    if cold_rows:
        title = "Stage 1 at zero (min_replicas 0): a request's latency"
        report.add(md_table(["request", "p50", "max", "times"], cold_rows, title=title))
    wave_ratio = auto.replica_seconds(wave_t, end) / static_max
    report.targets += [
        Target(
            "p99 back under target after the step",
            auto.recovery_s(step_t, wave_t),
            RECOVERY_BOUND_S,
            False,
            "s",
            lambda v: f"{v:.1f}",
        ),
        Target(
            f"p99 back under target after the step, {STANDBY} warm standby",
            spared.recovery_s(step_t, wave_t),
            RECOVERY_BOUND_S,
            False,
            "s",
            lambda v: f"{v:.1f}",
        ),
        Target(
            "failed requests (autoscaled, with and without standby)",
            float(auto.failed() + spared.failed()),
            0.0,
            False,
            "",
            lambda v: f"{v:.0f}",
        ),
        Target(
            "replica-seconds vs static max, square wave",
            wave_ratio * 100,
            60.0,
            False,
            "%",
            lambda v: f"{v:.0f}",
        ),
    ]
    report.notes.append(
        f"The replica-second bound: a square wave spending two thirds of its time low cannot "
        f"go below (2 x low + high replicas) / 3 / max = (2 x {MIN_REPLICAS} + {MAX_REPLICAS}) "
        f"/ 3 / {MAX_REPLICAS} = {(2 * MIN_REPLICAS + MAX_REPLICAS) / 3 / MAX_REPLICAS:.1%} of "
        "static max when the peak needs max; every replica start (~10 s here) adds to that. "
        f"The deployment with {STANDBY} standby keeps one replica more at every level (the "
        f"price of its fast step: "
        f"{spared.replica_seconds(wave_t, end) / static_max:.0%} of static max in the wave)."
    )
    report.notes.append(
        "p99 recovery counts from the step until every 2 s window stays under the target to the "
        "end of the step: on this shared machine static max spikes too (see the plot)."
    )
    if not opts.quick:
        static = traces[-1]
        report.notes.append(
            f"Square-wave goodput autoscaled {auto.goodput(wave_t, end):.1f}/s vs static max "
            f"{static.goodput(wave_t, end):.1f}/s: the replica-second ratio holds only at equal "
            "goodput."
        )
        png = ROOT / "docs" / "autoscale.png"
        try:
            from benchmarks.autoscale_plot import plot

            plot(traces, png, target_s=TARGET_P99_S)
            report.notes.append(f"Plot: {png.relative_to(ROOT)} (load, stage-1 replicas, p99).")
        except ImportError as exc:  # matplotlib: pip install -e '.[bench]'
            report.notes.append(f"No plot ({exc}): install the bench extra.")
    for tr in traces:
        if tr.errors:
            report.notes.append(f"{tr.label} errors, e.g.: {'; '.join(tr.errors[:3])}")
    return report
