"""Statistics, /proc readings (RSS, CPU time, process trees) and markdown tables."""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


# ---- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


# ---- /proc -----------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """CPU time of one process (not its children): its live threads' schedstat (ns
    resolution), or the clock-tick utime + stime of /proc/PID/stat when that is more: the
    latter also counts threads that have exited (an engine that runs each request's
    ``generate`` in a thread of its own)."""
    fields = _stat_fields(pid)
    ticks = 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / CLK_TCK
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return ticks
    return max(total / 1e9, ticks)


def sched_wait_seconds(pid: int) -> float:
    """Time the threads of ``pid`` spent runnable but waiting for a CPU (schedstat)."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all CPUs, /proc/stat)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


class NoiseMeter:
    """How much CPU other tenants of this shared machine used during a benchmark: machine busy
    time minus this process's and its (reaped) children's CPU time."""

    def __init__(self) -> None:
        self._busy0 = machine_busy_seconds()
        self._own0 = _own_cpu()
        self._t0 = time.monotonic()

    def foreign_cores(self) -> float:
        """Average number of cores used by processes that are not this benchmark's."""
        wall = time.monotonic() - self._t0
        busy = machine_busy_seconds() - self._busy0
        own = _own_cpu() - self._own0
        return max(0.0, busy - own) / wall if wall > 0 else math.nan


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (0 when it is gone)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * PAGE


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's children list)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(out))


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


@dataclass
class ProcessSet:
    """Processes a benchmark started, grouped by kind (sidecar, engine, omni-cp, redis, …)."""

    kinds: dict[str, list[int]] = field(default_factory=dict)

    def add(self, kind: str, pid: int) -> None:
        self.kinds.setdefault(kind, []).append(pid)

    def pids(self, kinds: Iterable[str] | None = None) -> list[int]:
        wanted = set(self.kinds) if kinds is None else set(kinds)
        return [p for k, ps in self.kinds.items() if k in wanted for p in ps]

    def cpu(self, kinds: Iterable[str] | None = None) -> float:
        return sum(cpu_seconds(p) for p in self.pids(kinds))

    def rss(self) -> dict[str, list[int]]:
        return {k: [rss_bytes(p) for p in ps] for k, ps in self.kinds.items()}


@dataclass
class RssReport:
    """RSS per process kind at two moments (idle after start-up, after the load)."""

    idle: dict[str, list[int]] = field(default_factory=dict)
    loaded: dict[str, list[int]] = field(default_factory=dict)

    def table(self, title: str = "RSS of every process kind started") -> str:
        rows = []
        for kind in self.idle or self.loaded:
            idle = [v for v in self.idle.get(kind, []) if v]
            loaded = [v for v in self.loaded.get(kind, []) if v]
            rows.append(
                [
                    kind,
                    str(len(idle) or len(loaded)),
                    fmt_mb(median(idle)) if idle else "-",
                    fmt_mb(max(idle)) if idle else "-",
                    fmt_mb(max(loaded)) if loaded else "-",
                ]
            )
        return md_table(
            ["process kind", "count", "RSS idle, median", "RSS idle, max", "RSS after load, max"],
            rows,
            title=title,
        )


class CpuMeter:
    """CPU seconds spent by groups of processes between ``start()`` and ``stop()``."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = {k: list(v) for k, v in groups.items()}
        self._t0: dict[str, float] = {}
        self._wait0: dict[str, float] = {}
        self.used: dict[str, float] = {}
        self.waited: dict[str, float] = {}
        self._self0 = 0.0
        self.wall = 0.0
        self._w0 = 0.0

    def start(self) -> None:
        self._t0 = {k: sum(cpu_seconds(p) for p in ps) for k, ps in self.groups.items()}
        self._wait0 = {k: sum(sched_wait_seconds(p) for p in ps) for k, ps in self.groups.items()}
        self._self0 = _self_cpu()
        self._w0 = time.monotonic()

    def stop(self) -> None:
        self.used = {
            k: sum(cpu_seconds(p) for p in ps) - self._t0[k] for k, ps in self.groups.items()
        }
        self.used["client"] = _self_cpu() - self._self0
        self.waited = {
            k: sum(sched_wait_seconds(p) for p in ps) - self._wait0[k]
            for k, ps in self.groups.items()
        }
        self.wall = time.monotonic() - self._w0


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


# ---- baselines -------------------------------------------------------------------------------


def memcpy_gbps(nbytes: int, repeats: int = 7) -> float:
    """Median GB/s of copying ``nbytes`` between two prefaulted buffers (numpy copyto)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / median(times) / 1e9


# ---- formatting ------------------------------------------------------------------------------


def fmt_ms(seconds: float, digits: int = 2) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.{digits}f}"


def fmt_us(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e6:.0f}"


def fmt_mb(nbytes: float) -> str:
    return "-" if math.isnan(nbytes) else f"{nbytes / MIB:.0f} MB"


def fmt_num(value: float, digits: int = 0) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def fmt_ratio(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}x"


def md_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, title: str = "", notes: str = ""
) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = []
    if title:
        out += [f"#### {title}", ""]
    out.append(line(headers))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += [line(r) for r in rows]
    if notes:
        out += ["", notes.strip()]
    return "\n".join(out) + "\n"


@dataclass
class Target:
    """One target of the issue: a figure, a bound and whether it is met."""

    name: str
    figure: float
    bound: float
    higher_is_better: bool
    unit: str
    fmt: Callable[[float], str] = field(default=lambda v: f"{v:,.2f}")

    @property
    def met(self) -> bool:
        if math.isnan(self.figure):
            return False
        return self.figure >= self.bound if self.higher_is_better else self.figure <= self.bound

    def row(self) -> list[str]:
        sign = "≥" if self.higher_is_better else "≤"
        return [
            self.name,
            f"{self.fmt(self.figure)} {self.unit}".strip(),
            f"{sign} {self.fmt(self.bound)} {self.unit}".strip(),
            "met" if self.met else "**missed**",
        ]


def targets_table(targets: Sequence[Target]) -> str:
    return md_table(
        ["target", "measured", "bound", "verdict"], [t.row() for t in targets], title="Targets"
    )


def machine_summary() -> str:
    """One line about the machine the figures come from."""
    cpu = "unknown CPU"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal"):
                mem = int(ln.split()[1]) // (1024 * 1024)
    except OSError:
        pass
    load = os.getloadavg()
    kernel = platform.release()
    py = platform.python_version()
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {mem} GiB RAM, Linux {kernel}, Python {py}, "
        f"load average at start {load[0]:.2f}"
    )


def git_revision(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"
