"""py-spy profiles of running processes, summarised as "where the CPU goes" tables.

py-spy is a dev tool (``.venv/bin/pip install py-spy``); without it profiling is skipped with
a note. Samples are taken with ``--nonblocking`` (the target is not paused) in ``raw``
(collapsed stacks) format, then folded into self and inclusive time per function.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from benchmarks.measure import md_table


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class Profiler:
    """Record every pid of ``targets`` ({label: pid}) for ``seconds`` into ``out_dir``."""

    def __init__(self, targets: Mapping[str, int], out_dir: Path, seconds: float) -> None:
        self.targets = dict(targets)
        self.out_dir = out_dir
        self.seconds = seconds
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.files: dict[str, Path] = {}

    def start(self) -> bool:
        exe = py_spy()
        if exe is None:
            return False
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for label, pid in self.targets.items():
            path = self.out_dir / f"{label}.txt"
            argv = [exe, "record", "-p", str(pid), "-d", str(max(1, round(self.seconds)))]
            argv += ["-r", "200", "-f", "raw", "-o", str(path)]
            self.procs[label] = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            self.files[label] = path
        return True

    def wait(self) -> None:
        for proc in self.procs.values():
            try:
                proc.wait(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def summaries(self, top: int = 12) -> str:
        return "\n".join(summarise(label, path, top) for label, path in self.files.items())


def _frame_name(frame: str) -> str:
    # py-spy raw frames look like "function (path/to/module.py:123)"
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path = where.rsplit(":", 1)[0]
    short = "/".join(Path(path).parts[-2:]) if path else "?"
    return f"{name} ({short})"


#: Leaf frames of threads that wait (py-spy does not always see these threads as idle).
IDLE_LEAVES = (
    "BlockingChannel._fill ",
    "BlockingChannel._wait ",
    "Condition.wait ",
    "Event.wait ",
    "Thread.join ",
    "_worker ",  # an idle thread-pool worker (blocked in its queue's C get)
    "select ",
    "poll ",
)


def fold(path: Path) -> tuple[Counter[str], Counter[str], int]:
    """Self and inclusive sample counts per function, and the total samples (stacks that end
    in a blocking wait are left out)."""
    self_counts: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    if not path.exists():
        return self_counts, incl, 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";") if f]
        if not frames or frames[-1].startswith(IDLE_LEAVES):
            continue
        total += count
        self_counts[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    return self_counts, incl, total


def summarise(label: str, path: Path, top: int = 12) -> str:
    self_counts, incl, total = fold(path)
    if total == 0:
        return f"#### profile: {label}\n\n(no samples)\n"
    rows = [
        [f, f"{100 * n / total:.1f}%", f"{100 * incl[f] / total:.1f}%"]
        for f, n in self_counts.most_common(top)
    ]
    return md_table(
        ["function (self time)", "self", "inclusive"],
        rows,
        title=f"profile: {label} ({total} samples while busy, {path.name})",
    )
