"""autoscale — per-stage autoscaling under ``omni-up``: the synthetic pipeline with a slow stage 1
(a 200 ms engine step, 4 requests per step and per replica: one replica carries at most
20 requests/s), an open-loop load of ``/v1/generate`` that steps from 6 to 40 requests/s (what
one replica cannot carry) and then follows a square wave between the two.

The same load runs three times: with stage 1 autoscaled (``min_replicas: 1``,
``max_replicas: 6``, target utilization 0.6), and against static pools at the minimum (1) and
at the maximum (6). Figures: the time from the step until the p99 latency (of the requests sent
in the last 2 s) is back under the target for good, failed requests (non-200 answers, and
arrivals the generator had to drop with ``MAX_OUTSTANDING`` requests already waiting),
replica-seconds of stage 1 (its processes, sampled every 0.25 s: starting and draining ones
count) and goodput (requests answered 200 within the latency target, per second).

Last, the cold start of a stage at zero (``min_replicas: 0``): a request that finds stage 1 with
no replica waits while the hop client wakes it and omni-up starts one; its latency against the
same request with a replica warm. A PNG of load, replicas and p99 over time goes to
``docs/autoscale.png`` (matplotlib: the ``bench`` extra). ``--quick`` runs a shorter profile
and only the autoscaled deployment (no static runs, no PNG).

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
    policy = AUTOSCALE.format(min=MIN_REPLICAS, max=MAX_REPLICAS, down_window=opts.pickf(4, 3))
    with tempfile.TemporaryDirectory(prefix="omni-bench-autoscale-") as tmp_name:
        tmp = Path(tmp_name)
        traces = [await run(tmp, "autoscaled", deploy_yaml(start=1, autoscale=policy), 1, opts)]
        if not opts.quick:
            for n in (MIN_REPLICAS, MAX_REPLICAS):
                traces.append(await run(tmp, f"static {n}", deploy_yaml(start=n), n, opts))
        try:
            cold, warm = await cold_start(tmp, opts.repetitions(3, 1))
        except (RuntimeError, AssertionError, aiohttp.ClientError) as exc:
            cold, warm = [], []
            report.notes.append(f"Cold start from zero not measured: {exc}")
    auto = traces[0]
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
    if cold:
        cold_rows = [
            [
                "first request (wake, start, READY)",
                f"{percentile(cold, 50):.2f} s",
                f"{max(cold):.2f} s",
            ],
            ["the next one (warm)", f"{percentile(warm, 50):.3f} s", f"{max(warm):.3f} s"],
        ]
        title = f"Stage 1 at zero: a request's latency ({len(cold)} times)"
        report.add(md_table(["request", "p50", "max"], cold_rows, title=title))
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
            "failed requests (autoscaled)",
            float(auto.failed()),
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
        f"The replica-second bound: a square wave spending half its time at each level cannot "
        f"go below (low + high replicas) / 2 / max = ({MIN_REPLICAS} + {MAX_REPLICAS}) / 2 / "
        f"{MAX_REPLICAS} = {(MIN_REPLICAS + MAX_REPLICAS) / 2 / MAX_REPLICAS:.1%} of static max "
        "when the peak needs max; every replica start (~10 s here) adds to that."
    )
    report.notes.append(
        "p99 recovery counts from the step until every 2 s window stays under the target to the "
        "end of the step: on this shared machine static max spikes too (see the plot)."
    )
    if not opts.quick:
        static = traces[2]
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
