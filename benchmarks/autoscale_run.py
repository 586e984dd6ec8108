"""One run of the autoscaling benchmark (:mod:`benchmarks.autoscale`): the deploy YAML of the
synthetic pipeline, ``omni-up`` around it, the open-loop ``/v1/generate`` load that follows a
list of phases, and the :class:`Trace` it records (every request's latency, stage-1 replicas
sampled every ``SAMPLE_S``, when omni-up started replicas); also the cold start from zero.
The tables and targets built from these traces are :mod:`benchmarks.autoscale`'s job.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp

from benchmarks.common import Options
from benchmarks.measure import percentile
from omni_mesh.procutil import free_port
from tests.procs import ManagedProcess, clean_env, pid_alive

PIPELINE = "synthetic"
STEP_MS = 200.0
SEQS = 2  # per step and replica: 10 requests/s per replica
INFLIGHT = 16  # per replica: beyond SEQS, requests queue in its engine (FIFO, counted as queued)
LOW_RPS, HIGH_RPS = 3.0, 16.0
MIN_REPLICAS, MAX_REPLICAS = 1, 4
STANDBY = 2  # warm standby replicas of the deployment that has them (the step needs ~3)
TARGET_P99_S = 1.0
RECOVERY_BOUND_S = 10.0
MAX_OUTSTANDING = 200  # arrivals beyond this many unanswered requests are dropped (failed)
WINDOW_S = 2.0  # p99 over the requests sent in the last WINDOW_S
SAMPLE_S = 0.25
#: The hop liveness prober is tuned for silent hosts (a probe must connect within 0.3 s): on a
#: loopback machine whose cores are saturated, an overloaded pod's /health misses that and
#: every hop to it is failed and replayed. Loopback has no silent hosts: give probes time.
LIVENESS_ENV = {"OMNI_STAGE_HOP_CONNECT_TIMEOUT_S": "3", "OMNI_STAGE_HOP_PROBE_TIMEOUT_S": "10"}

STAGES = """\
pipeline: synthetic
request_timeout_s: {timeout}
hop_retries: 2
connectors:
  shm: {{name: SharedMemoryConnector}}
  http: {{name: HttpConnector}}
stages:
  - {{stage_id: 0, max_num_seqs: 64, max_inflight: 512, output_bytes: 64,
      output_connectors: {{to_stage_1: shm}}}}
  - stage_id: 1
    num_replicas: {start}
    max_num_seqs: {seqs}
    max_inflight: {inflight}
    step_latency_ms: {step_ms}
    output_bytes: 64
    input_connectors: {{from_stage_0: shm}}
    output_connectors: {{to_stage_2: shm}}
{autoscale}
  - {{stage_id: 2, max_num_seqs: 64, max_inflight: 512, output_bytes: 64,
      input_connectors: {{from_stage_1: shm}}}}
"""

AUTOSCALE = """\
    autoscale:
      min_replicas: {min}
      max_replicas: {max}
      target_utilization: 0.6
      scale_up_window_s: 1.0
      scale_down_window_s: {down_window}
      max_scale_up_step: 4
      max_scale_down_step: {max}
      cooldown_s: 2.0
      standby_replicas: {standby}
"""


@dataclass
class Phase:
    name: str
    seconds: float
    rps: float


@dataclass
class Trace:
    """One run: every request (send time, latency or None when failed) and the samples."""

    label: str
    phases: list[Phase]
    sent: list[tuple[float, float | None]] = field(default_factory=list)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # t, processes, ready
    errors: list[str] = field(default_factory=list)
    started_at: float = 0.0  # wall clock of t = 0
    scale_ups: list[float] = field(default_factory=list)  # t of each replica omni-up started
    startups: list[float] = field(default_factory=list)  # seconds from start to ready
    answered_failed: int = 0  # failed answers (the rest of the failures: dropped arrivals)

    def fail(self, error: str) -> None:
        self.answered_failed += 1
        if len(self.errors) < 5:
            self.errors.append(error)

    def phase_start(self, name: str) -> float:
        t = 0.0
        for p in self.phases:
            if p.name == name:
                return t
            t += p.seconds
        raise KeyError(name)

    @property
    def duration(self) -> float:
        return sum(p.seconds for p in self.phases)

    def replica_seconds(self, t0: float, t1: float) -> float:
        pts = [(t, n) for t, n, _ in self.samples if t0 <= t < t1]
        return sum(n for _, n in pts) * SAMPLE_S

    def failed(self, t0: float = 0.0, t1: float = math.inf) -> int:
        return sum(1 for t, lat in self.sent if t0 <= t < t1 and lat is None)

    def goodput(self, t0: float, t1: float) -> float:
        good = sum(
            1 for t, lat in self.sent if t0 <= t < t1 and lat is not None and lat <= TARGET_P99_S
        )
        return good / (t1 - t0)

    def p99_series(self) -> list[tuple[float, float]]:
        """(t, p99 of the requests sent in [t - WINDOW_S, t)), failures counting as infinite."""
        out = []
        t = WINDOW_S
        while t <= self.duration + 1e-9:
            lats = [
                math.inf if lat is None else lat for s, lat in self.sent if t - WINDOW_S <= s < t
            ]
            out.append((t, percentile(lats, 99) if lats else math.nan))
            t += 0.5
        return out

    def recovery_s(self, start: float, end: float) -> float:
        """From ``start`` until the windowed p99 stays under the target until ``end``."""
        last_bad = start
        for t, p99 in self.p99_series():
            if start < t <= end and not p99 <= TARGET_P99_S:
                last_bad = t
        return math.inf if last_bad >= end else last_bad - start


def profile(opts: Options) -> list[Phase]:
    """Warm, the step, then a square wave whose low phase is twice its high one (load that
    peaks a third of the time, as a day's traffic does: the fair test of what autoscaling
    saves; with equal halves every replica start eats into a short low phase)."""
    warm, step = opts.pickf(10.0, 5.0), opts.pickf(40.0, 20.0)
    high, cycles = opts.pickf(30.0, 10.0), opts.pick(2, 1)
    phases = [Phase("warm", warm, LOW_RPS), Phase("step", step, HIGH_RPS)]
    for i in range(cycles):
        phases += [
            Phase(f"wave-low-{i}", 2 * high, LOW_RPS),
            Phase(f"wave-high-{i}", high, HIGH_RPS),
        ]
    return phases


# ---- one deployment ----------------------------------------------------------------------------


class Deployment:
    """``omni-up`` for the synthetic pipeline with a deploy YAML of ours; stopped on exit."""

    def __init__(self, tmp: Path, yaml_text: str, replicas: str, label: str) -> None:
        self.port, self.cp_port = free_port(), free_port()
        deploy = tmp / f"{label}.yaml"
        deploy.write_text(yaml_text)
        argv = [
            sys.executable,
            "-m",
            "omni_mesh.launcher.cli",
            "--pipeline",
            PIPELINE,
            "--port",
            str(self.port),
            "--cp-port",
            str(self.cp_port),
            "--deploy-config",
            str(deploy),
            "--replicas",
            replicas,
            "--drain-timeout",
            "20",
            "--log-level",
            "info",
        ]
        env = clean_env(LIVENESS_ENV)
        self.proc = ManagedProcess(argv, name=f"omni-up-{label}", env=env, log_dir=tmp)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Deployment:
        self.proc.start()
        self.proc.wait_for_output(r"omni-up ready: ", timeout=180)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=90)
        finally:
            self.proc.cleanup()

    def stage1(self) -> int:
        """Stage-1 replica processes omni-up runs now (starting and draining ones too)."""
        pid, n = self.proc.pid, 0
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if "--headless" in argv and argv[argv.index("--stage-id") + 1] == "1":
                n += pid_alive(int(child))
        return n

    def ready(self) -> int:
        return len(self._instances(all_states=False))

    def standby(self) -> int:
        return sum(1 for i in self._instances(all_states=True) if i.get("state") == "standby")

    def _instances(self, *, all_states: bool) -> list[dict[str, object]]:
        url = f"http://127.0.0.1:{self.cp_port}/v1/pipelines/{PIPELINE}/stages/1/instances"
        try:
            with urllib.request.urlopen(url + ("?all=1" if all_states else ""), timeout=1) as r:
                found: list[dict[str, object]] = json.loads(r.read())["instances"]
                return found
        except (OSError, ValueError, KeyError):
            return []


async def drive(dep: Deployment, trace: Trace) -> None:
    """Open-loop arrivals at each phase's rate; samples replicas meanwhile."""
    loop_t0 = time.monotonic()
    trace.started_at = time.time()
    outstanding: set[asyncio.Task[None]] = set()
    conn = aiohttp.TCPConnector(limit=MAX_OUTSTANDING, limit_per_host=MAX_OUTSTANDING)
    async with aiohttp.ClientSession(connector=conn) as sess:

        async def one(i: int, sent: float) -> None:
            latency: float | None = None
            try:
                async with sess.post(
                    f"{dep.url}/v1/generate", json={"prompt": "x", "seed": i}
                ) as resp:
                    body = await resp.read()
                    if resp.status == 200:
                        latency = time.monotonic() - loop_t0 - sent
                    else:
                        trace.fail(f"HTTP {resp.status}: {body[:200]!r}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                trace.fail(f"{type(exc).__name__}: {exc}")
            trace.sent.append((sent, latency))

        async def sample() -> None:
            while True:
                t = time.monotonic() - loop_t0
                n, ready = await asyncio.to_thread(lambda: (dep.stage1(), dep.ready()))
                trace.samples.append((t, n, ready))
                await asyncio.sleep(max(0.0, SAMPLE_S - (time.monotonic() - loop_t0 - t)))

        sampler = asyncio.create_task(sample())
        i, next_at = 0, 0.0
        for phase_end, rps in _boundaries(trace.phases):
            while next_at < phase_end:
                await asyncio.sleep(max(0.0, next_at - (time.monotonic() - loop_t0)))
                if len(outstanding) >= MAX_OUTSTANDING:
                    trace.sent.append((next_at, None))  # dropped: counted as failed
                else:
                    task = asyncio.create_task(one(i, next_at))
                    outstanding.add(task)
                    task.add_done_callback(outstanding.discard)
                i += 1
                next_at += 1.0 / rps
        if outstanding:
            await asyncio.wait(outstanding, timeout=90)
        sampler.cancel()


_STARTED = re.compile(
    r"^(\S+ \S+) omni-up INFO autoscale stage=1 starting (?:standby )?process=", re.M
)
_READY = re.compile(r"process=stage1-\S+ pid=\d+ is ready ([0-9.]+)s after its start")


def _actuator_log(log: str, trace: Trace) -> None:
    """When omni-up started stage-1 replicas (t) and how long each took to be ready."""
    for stamp in _STARTED.findall(log):
        wall = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        trace.scale_ups.append(wall - trace.started_at)
    trace.startups += [float(s) for s in _READY.findall(log)]


def _boundaries(phases: list[Phase]) -> list[tuple[float, float]]:
    out, t = [], 0.0
    for p in phases:
        t += p.seconds
        out.append((t, p.rps))
    return out


def deploy_yaml(*, start: int, autoscale: str = "", timeout: int = 30) -> str:
    return STAGES.format(
        timeout=timeout,
        start=start,
        seqs=SEQS,
        inflight=INFLIGHT,
        step_ms=STEP_MS,
        autoscale=autoscale.rstrip("\n"),
    )


async def run(tmp: Path, label: str, yaml_text: str, replicas: int, opts: Options) -> Trace:
    trace = Trace(label, profile(opts))
    with Deployment(tmp, yaml_text, f"1:{replicas}:1", label) as dep:
        await asyncio.sleep(1.0)
        await drive(dep, trace)
        _actuator_log(dep.proc.stderr, trace)
    dropped = sum(1 for _, lat in trace.sent if lat is None) - trace.answered_failed
    print(
        f"[autoscale] {label}: {len(trace.sent)} requests, {trace.failed()} failed "
        f"({dropped} dropped by the generator), e.g. {trace.errors[:3]}",
        flush=True,
    )
    return trace


async def cold_start(tmp: Path, reps: int, standby: int = 0) -> tuple[list[float], list[float]]:
    """Latency of one request that finds stage 1 at zero (with ``standby`` warm standbys),
    and of the same with a replica serving."""
    policy = AUTOSCALE.format(min=0, max=1, down_window=1.0, standby=standby)
    cold: list[float] = []
    warm: list[float] = []
    label = f"cold-standby-{standby}"
    with Deployment(tmp, deploy_yaml(start=1, autoscale=policy), "1:1:1", label) as dep:
        async with aiohttp.ClientSession() as sess:
            for i in range(reps):
                await _until_zero(dep, standby)
                for bucket in (cold, warm):
                    t0 = time.monotonic()
                    async with sess.post(
                        f"{dep.url}/v1/generate", json={"prompt": "x", "seed": i}
                    ) as resp:
                        body = await resp.read()
                        if resp.status != 200:
                            raise RuntimeError(f"cold start: HTTP {resp.status}: {body[:200]!r}")
                    bucket.append(time.monotonic() - t0)
    return cold, warm


async def _until_zero(dep: Deployment, standby: int, timeout_s: float = 60.0) -> None:
    """Until stage 1 serves with no replica, and its ``standby`` standbys are registered."""
    deadline = time.monotonic() + timeout_s
    while dep.stage1() > standby or dep.ready() or dep.standby() < standby:
        if time.monotonic() > deadline:
            raise RuntimeError("cold start: stage 1 did not scale to zero")
        await asyncio.sleep(0.2)
