"""The autoscaling benchmark's figure: offered load, stage-1 replicas and windowed p99 over time
for each deployment (matplotlib, the ``bench`` extra; headless Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.autoscale_run import Trace


def plot(traces: Sequence[Trace], path: Path, *, target_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_load, ax_rep, ax_p99) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    first = traces[0]
    t, xs, ys = 0.0, [], []
    for p in first.phases:
        xs += [t, t + p.seconds]
        ys += [p.rps, p.rps]
        t += p.seconds
    ax_load.plot(xs, ys, color="black")
    ax_load.set_ylabel("offered load (req/s)")
    for tr in traces:
        ax_rep.step(
            [s[0] for s in tr.samples],
            [s[1] for s in tr.samples],
            where="post",
            label=f"{tr.label} (processes)",
        )
        series = [(x, y) for x, y in tr.p99_series() if not math.isnan(y)]
        ax_p99.plot([x for x, _ in series], [min(y, 30.0) for _, y in series], label=tr.label)
    ready = [(s[0], s[2]) for s in first.samples if s[2] >= 0]  # -1: the sample failed
    ax_rep.plot(
        [t for t, _ in ready],
        [n for _, n in ready],
        linestyle=":",
        color="gray",
        label=f"{first.label} (ready in discovery)",
    )
    ax_rep.set_ylabel("stage-1 replicas")
    ax_rep.legend(loc="upper left", fontsize=8)
    ax_p99.axhline(target_s, color="red", linestyle="--", label="target")
    ax_p99.set_yscale("log")
    ax_p99.set_ylabel("p99 latency, 2 s windows (s)")
    ax_p99.set_xlabel("time (s)")
    ax_p99.legend(loc="upper left", fontsize=8)
    fig.suptitle("omni-up autoscaling: synthetic pipeline, slow stage 1")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
