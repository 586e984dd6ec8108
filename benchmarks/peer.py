"""peer — the same 3-stage no-op and synthetic pipelines on omni-mesh and on Ray Serve, in one
run: latency (c=1) and throughput (c=64), and the ratios omni-mesh / Ray Serve.

omni-mesh: omni-cp, one pod per stage of ``synthetic`` and an ``--api-only`` API server; the
client calls ``POST /v1/generate`` (JSON in, JSON out with the final output base64): the
client-facing route, like Ray's HTTP ingress. The synthetic variant runs the latency model
and output sizes of ``omni_mesh/configs/deploy/synthetic.yaml``'s example
(s0 25 ms + 1.5 ms/item, 4 MiB; s1 12 + 0.5, 256 KiB; s2 5 + 0.2, 96,000 bytes) via
``--stage-overrides``. ``POST /v1/hop`` straight to stage 0 is shown too.

Ray Serve (:mod:`benchmarks.ray_app`, run by ``benchmarks/.ray-venv``, which this module
creates on first use with ``pip install ray[serve]``): an HTTP ingress deployment chaining three
stage deployments by handle, with the same latency model (``@serve.batch`` of 8). The systems
run one after the other (never side by side) with the same load generator; each figure is the
median of several runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from benchmarks.common import Options, Report, generate_caller, hop_caller
from benchmarks.fabric import Fabric
from benchmarks.load import LoadResult, RequestFn, expect_ok, run_load
from benchmarks.measure import (
    RssReport,
    Target,
    alive,
    cmdline,
    descendants,
    fmt_mb,
    fmt_ms,
    fmt_num,
    md_table,
    ratio,
    rss_bytes,
)
from tests.procs import LOCALHOST, ManagedProcess, clean_env, free_port

RAY_VERSION = "2.60.0"
RAY_VENV = Path(__file__).resolve().parent / ".ray-venv"
SYNTHETIC_OVERRIDES = {
    "0": {"step_latency_ms": 25, "per_item_latency_ms": 1.5, "output_bytes": 4 * 1024 * 1024},
    "1": {"step_latency_ms": 12, "per_item_latency_ms": 0.5, "output_bytes": 256 * 1024},
    "2": {"step_latency_ms": 5, "per_item_latency_ms": 0.2, "output_bytes": 96000},
}


def ray_python() -> Path:
    """The Ray venv's interpreter; creates the venv (``pip install ray[serve]``) if needed."""
    py = RAY_VENV / "bin" / "python"
    check = [str(py), "-c", "import ray, ray.serve, starlette, numpy"]
    if py.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return py
    print(f"[peer] creating {RAY_VENV} with ray[serve]=={RAY_VERSION} (one-time)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(RAY_VENV)], check=True)
    (RAY_VENV / ".gitignore").write_text("*\n")
    pip = [str(RAY_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    out = subprocess.run(
        [*pip, f"ray[serve]=={RAY_VERSION}", "numpy"], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"pip install ray[serve] failed:\n{out.stderr[-2000:]}")
    return py


@dataclass
class Series:
    """One (system, pipeline, route) measured at c=1 and c=64 over several runs."""

    label: str
    fn: RequestFn
    c1: list[LoadResult] = field(default_factory=list)
    c64: list[LoadResult] = field(default_factory=list)

    def p(self, which: str, q: float) -> float:
        runs = self.c1 if which == "c1" else self.c64
        return median(r.p(q) for r in runs) if runs else math.nan

    def thr(self) -> float:
        return median(r.throughput for r in self.c64) if self.c64 else math.nan


async def _measure(series: list[Series], opts: Options, c1_n: dict[str, int]) -> None:
    reps = opts.repetitions(5, 2)
    dur = opts.pickf(5.0, 1.2)
    for s in series:  # warm-up
        await run_load(s.fn, concurrency=8, requests=opts.pick(100, 30), warmup_s=0.2)
    for _ in range(reps):
        for s in series:
            n = c1_n["syn" if "synthetic" in s.label else "noop"]
            res = await run_load(s.fn, concurrency=1, requests=n, warmup_s=0.05)
            res.check(s.label + " c=1")
            s.c1.append(res)
            res = await run_load(s.fn, concurrency=64, duration_s=dur, warmup_s=opts.pickf(1, 0.5))
            res.check(s.label + " c=64")
            s.c64.append(res)


async def _omni(opts: Options, c1_n: dict[str, int], rss: dict[str, RssReport]) -> list[Series]:
    out: list[Series] = []
    for kind, overrides in (("no-op", None), ("synthetic", SYNTHETIC_OVERRIDES)):
        with Fabric(f"peer-{kind}", stage_overrides=overrides) as fab:
            fab.start_cp()
            stages = [fab.add_stage(s, wait=False) for s in (0, 1, 2)]
            api = fab.add_stage(0, api_only=True, wait=False)
            own = fab.add_stage(0, serve_api=True, wait=False) if kind == "no-op" else None
            fab.wait_ready()
            for s in (0, 1, 2):
                fab.wait_discovered(s, 1 if own is None or s else 2)
            await asyncio.sleep(0.5)
            report = RssReport(idle=fab.processes().rss())
            series = [Series(f"omni-mesh {kind}, /v1/generate", generate_caller(api.url))]
            if own is not None:
                series.append(
                    Series(
                        f"omni-mesh {kind}, /v1/generate on a stage-0 pod",
                        generate_caller(own.url),
                    )
                )
                series.append(
                    Series(
                        f"omni-mesh {kind}, /v1/hop to stage 0", hop_caller(stages[0].url, 0, "p")
                    )
                )
            await _measure(series, opts, c1_n)
            report.loaded = fab.processes().rss()
            rss[f"omni-mesh ({kind})"] = report
            out += series
    return out


class RayServe:
    """The Ray Serve side as one driver process (and the ~20 processes Ray starts)."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="omni-bench-ray-"))
        self.port = free_port()
        self.proc: ManagedProcess | None = None

    def start(self) -> None:
        py = ray_python()
        env = clean_env({"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"})
        env.pop("PYTHONPATH", None)
        script = Path(__file__).resolve().parent / "ray_app.py"
        argv = [str(py), str(script), "--port", str(self.port), "--temp-dir", str(self.tmp)]
        self.proc = ManagedProcess(argv, name="ray-serve", env=env, log_dir=self.tmp).start()
        self.proc.wait_for_output(r"RAY-READY", timeout=300)

    def pids(self) -> list[int]:
        """The driver, its descendants, and any process whose command line names our temp dir
        (Ray daemons that left the driver's process tree)."""
        found: set[int] = set()
        if self.proc is not None and self.proc.alive:
            found.add(self.proc.pid)
            found.update(descendants(self.proc.pid))
        marker = str(self.tmp)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and marker in cmdline(int(entry.name)):
                found.add(int(entry.name))
        return sorted(p for p in found if alive(p) and p != os.getpid())

    def rss(self) -> list[int]:
        return [rss_bytes(p) for p in self.pids()]

    def url(self, app: str) -> str:
        return f"http://{LOCALHOST}:{self.port}/{app}"

    def stop(self) -> None:
        leftovers = self.pids()
        if self.proc is not None:
            self.proc.terminate(timeout=60)
        for pid in leftovers:  # by pid: only processes of this Ray instance
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)


def ray_caller(url: str) -> RequestFn:
    async def call(sess: object, i: int) -> None:
        async with sess.post(url, json={"prompt": "x", "seed": i}) as resp:  # type: ignore[attr-defined]
            await expect_ok(resp)

    return call


async def bench(opts: Options) -> Report:
    report = Report("peer", "peer: omni-mesh vs Ray Serve, same pipelines, same client")
    c1_n = {"noop": opts.pick(300, 60), "syn": opts.pick(60, 15)}
    rss: dict[str, RssReport] = {}
    omni = await _omni(opts, c1_n, rss)
    ray = RayServe()
    try:
        await asyncio.to_thread(ray.start)
        await asyncio.sleep(1.0)
        ray_idle = ray.rss()
        rays = [
            Series("Ray Serve no-op, HTTP ingress", ray_caller(ray.url("noop"))),
            Series("Ray Serve synthetic, HTTP ingress", ray_caller(ray.url("synthetic"))),
        ]
        await _measure(rays, opts, c1_n)
        ray_loaded = ray.rss()
    finally:
        await asyncio.to_thread(ray.stop)
    _tables(report, omni, rays, rss, ray_idle, ray_loaded, opts)
    return report


def _row(s: Series) -> list[str]:
    return [
        s.label,
        fmt_ms(s.p("c1", 50), 2),
        fmt_ms(s.p("c1", 99), 2),
        fmt_ms(s.p("c64", 50), 1),
        fmt_ms(s.p("c64", 99), 1),
        fmt_num(s.thr(), 0),
    ]


def _tables(
    report: Report,
    omni: list[Series],
    rays: list[Series],
    rss: dict[str, RssReport],
    ray_idle: list[int],
    ray_loaded: list[int],
    opts: Options,
) -> None:
    gen_noop, own_noop, hop_noop, gen_syn = omni
    ray_noop, ray_syn = rays
    report.add(
        md_table(
            [
                "system, pipeline, route",
                "p50 ms c=1",
                "p99 ms c=1",
                "p50 ms c=64",
                "p99 ms c=64",
                "req/s c=64",
            ],
            [_row(s) for s in (gen_noop, own_noop, hop_noop, ray_noop, gen_syn, ray_syn)],
            title="Latency and throughput",
            notes=(
                f"Median of {opts.repetitions(5, 2)} runs per row. Synthetic stages: s0 25 ms + "
                "1.5 ms/item (4 MiB out), s1 12 + 0.5 (256 KiB), s2 5 + 0.2 (96,000 bytes), "
                "batches of up to 8 on both systems."
            ),
        )
    )
    rows = []
    for name, o, r in (
        ("no-op, /v1/generate vs HTTP ingress", gen_noop, ray_noop),
        ("no-op, /v1/generate on a stage-0 pod vs HTTP ingress", own_noop, ray_noop),
        ("no-op, /v1/hop vs HTTP ingress", hop_noop, ray_noop),
        ("synthetic, /v1/generate vs HTTP ingress", gen_syn, ray_syn),
    ):
        rows.append(
            [
                name,
                f"{ratio(o.thr(), r.thr()):.1f}x",
                f"{ratio(o.p('c1', 50), r.p('c1', 50)):.3f}x",
                f"{ratio(o.p('c64', 99), r.p('c64', 99)):.3f}x",
            ]
        )
    report.add(
        md_table(
            ["omni-mesh / Ray Serve", "throughput c=64", "p50 latency c=1", "p99 latency c=64"],
            rows,
            title="Ratios (same run)",
        )
    )
    kinds = []
    for label, rep in rss.items():
        for kind in rep.idle:
            idle = [v for v in rep.idle[kind] if v]
            loaded = [v for v in rep.loaded.get(kind, []) if v]
            kinds.append(
                [f"{label}: {kind}", str(len(idle)), fmt_mb(sum(idle)), fmt_mb(sum(loaded))]
            )
    kinds.append(
        [
            "Ray Serve (every process of the instance)",
            str(len(ray_idle)),
            fmt_mb(sum(ray_idle)),
            fmt_mb(sum(ray_loaded)),
        ]
    )
    report.add(
        md_table(
            ["processes", "count", "RSS idle, total", "RSS after load, total"],
            kinds,
            title="RSS of every process kind started",
        )
    )
    report.targets += [
        Target(
            "3-stage no-op throughput c=64, omni-mesh (/v1/generate) / Ray Serve",
            ratio(gen_noop.thr(), ray_noop.thr()),
            10,
            True,
            "x",
            _f1,
        ),
        Target(
            "3-stage no-op p50 latency c=1, omni-mesh (/v1/generate) / Ray Serve",
            ratio(gen_noop.p("c1", 50), ray_noop.p("c1", 50)),
            0.1,
            False,
            "x",
            _f3,
        ),
    ]


def _f1(v: float) -> str:
    return f"{v:.1f}"


def _f3(v: float) -> str:
    return f"{v:.3f}"
