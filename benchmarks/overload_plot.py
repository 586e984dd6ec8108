"""The overload benchmark's figure: closed-loop latency and goodput against clients, open-loop
goodput and sheds against offered load (matplotlib, the ``bench`` extra; headless Agg)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks.common import ROOT, Report
from benchmarks.measure import percentile

if TYPE_CHECKING:
    from benchmarks.overload_load import Run


def plot(
    closed: list[Run], opened: list[Run], capacity: float, report: Report, *, stage1: str
) -> None:
    """Latency and goodput against load into ``docs/overload.png``; a line in ``report``."""
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
    fig.suptitle(f"omni-mesh under overload: synthetic pipeline, stage 1 at {stage1}")
    fig.tight_layout()
    out = ROOT / "docs" / "overload.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    report.add("![latency and goodput under overload](overload.png)\n")
