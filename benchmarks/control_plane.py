"""control-plane — what one ``omni-cp`` (with its embedded Redis) sustains, how fast pool changes
reach watchers, and how fast a killed replica leaves discovery.

1. Heartbeat capacity: simulated instances (registered through ``POST /v1/instances``) each
   send ``PUT /v1/instances/{id}/heartbeat`` once a second, phases spread over the second, from
   this process over a pool of keep-alive connections (:mod:`benchmarks.rawhttp`). The count is
   ramped; a level holds when, over its window, heartbeat p99 (measured from each heartbeat's
   *scheduled* time, so a client falling behind counts too) is at most 100 ms, nothing failed
   and every ack said ``healthy``. The ramp stops at the first level that does not hold.
2. Propagation: watchers (the sidecars' own :class:`PoolWatcher`, each with its own client)
   follow the ``synthetic`` pipeline while instances of it register and deregister; the time
   from the change request to each watcher's snapshot showing it, while 1,000 simulated
   instances of another pipeline heartbeat in the background.
3. kill -9: a real ``synthetic`` 1:2:1 topology; SIGKILL to the sidecar of one stage-1 replica
   (its engine follows by PDEATHSIG), then the time until the control plane's discovery
   (``GET …/stages/1/instances``) no longer lists it — with no traffic, and with a closed loop
   of requests flowing through stage 1 (where stage 0's router also ejects it on the first
   refused connection: that moment is read from stage 0's log).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from statistics import median

from benchmarks.common import Options, Report, hop_caller
from benchmarks.fabric import Fabric, Pod, http_json
from benchmarks.load import run_load
from benchmarks.measure import (
    CpuMeter,
    RssReport,
    Target,
    fmt_ms,
    fmt_num,
    md_table,
    percentile,
)
from benchmarks.profiling import Profiler
from benchmarks.rawhttp import LOCALHOST, RawConn, RawHttpError, RawHttpPool
from omni_mesh.control_plane.client import ControlPlaneClient, PipelineSnapshot, PoolWatcher

GOLDEN = 0.6180339887498949
HB_BODY = json.dumps(
    {"load": {"in_flight": 0, "queued": 0, "capacity": 64, "engine": {"step_ms": 1.0}}}
).encode()
P99_LIMIT_S = 0.100
MAX_OUTSTANDING = 50_000
# Keep-alive connections the simulated instances share. More than ~100 requests in flight make
# omni-cp answer 503 "Too many connections" (redis-py's default non-blocking pool of 100).
HB_CONNECTIONS = 64
BURST = 300
LEASE_S = 3.0  # omni-cp's default lease (--lease-ttl-ms 3000), which the benchmark keeps


# ---- 1. heartbeat capacity ---------------------------------------------------------------------


@dataclass
class Level:
    instances: int
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    unhealthy: int = 0
    error_samples: list[str] = field(default_factory=list)
    cp_cpu: float = math.nan  # fraction of one core
    redis_cpu: float = math.nan
    client_cpu: float = math.nan
    cp_waited: float = math.nan  # share of the window omni-cp was runnable, waiting for a CPU
    rate: float = math.nan

    @property
    def holds(self) -> bool:
        return (
            bool(self.latencies)
            and self.errors == 0
            and self.unhealthy == 0
            and percentile(self.latencies, 99) <= P99_LIMIT_S
        )


class Simulator:
    """Registered simulated instances and the 1 Hz heartbeat schedule that keeps them alive."""

    def __init__(self, pool: RawHttpPool, pipeline: str) -> None:
        self.pool = pool
        self.pipeline = pipeline
        self.ids: list[str] = []
        self.level: Level | None = None  # the window being measured
        self.outstanding = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._seq = 0

    async def register(self, count: int, concurrency: int = 32) -> None:
        todo = iter(range(count))

        async def one() -> None:
            for _ in todo:
                i = self._seq
                self._seq += 1
                body = {
                    "pipeline": self.pipeline,
                    "stage_id": i % 3,
                    "address": f"http://127.1.{i // 250 % 250}.{i % 250 + 1}:{9000 + i // 62500}",
                    "capacity": 64,
                    "host_id": f"sim-{i // 100}",
                }
                status, data = await self.pool.request(
                    "POST", "/v1/instances", json.dumps(body).encode(), limit_s=30
                )
                if status != 201:
                    raise RuntimeError(f"register: HTTP {status} {data[:200]!r}")
                self.ids.append(json.loads(data)["instance_id"])

        await asyncio.gather(*(one() for _ in range(concurrency)))

    async def run(self) -> None:
        """Heartbeat every registered instance once a second, at its own phase."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        second = 0
        while not self._stop.is_set():
            ids = list(self.ids)
            order = sorted(range(len(ids)), key=lambda i: (i * GOLDEN) % 1.0)
            base = t0 + second
            for i in order:
                due = base + (i * GOLDEN) % 1.0
                delay = due - loop.time()
                if delay > 0.002:
                    await asyncio.sleep(delay)
                if self._stop.is_set():
                    return
                if self.outstanding >= MAX_OUTSTANDING:
                    self._fail("client backlog over 50,000 heartbeats")
                    continue
                task = asyncio.create_task(self._beat(ids[i], due))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            second += 1
            delay = t0 + second - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)

    async def _beat(self, instance_id: str, due: float) -> None:
        loop = asyncio.get_running_loop()
        due = max(due, loop.time())  # sent up to 2 ms early: count from the send, then
        self.outstanding += 1
        try:
            status, data = await self.pool.request(
                "PUT", f"/v1/instances/{instance_id}/heartbeat", HB_BODY, limit_s=2.0
            )
        except RawHttpError as exc:
            self._fail(str(exc))
            return
        finally:
            self.outstanding -= 1
        level = self.level
        if level is None:
            return
        if status != 200:
            self._fail(f"HTTP {status} {data[:120]!r}")
        elif b'"healthy"' not in data:
            level.unhealthy += 1
        else:
            level.latencies.append(loop.time() - due)

    def _fail(self, why: str) -> None:
        level = self.level
        if level is not None:
            level.errors += 1
            if len(level.error_samples) < 3:
                level.error_samples.append(why[:200])

    async def stop(self) -> None:
        self._stop.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def heartbeat_ramp(opts: Options, fab: Fabric, report: Report) -> int:
    steps = (
        [1000, 2500, 5000, 7500, 10000, 15000, 20000]
        if opts.quick
        else [500, 1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 10000, 12000, 15000, 20000]
    )
    window = opts.pickf(8.0, 2.5)
    port = int(fab.cp_url.rsplit(":", 1)[1])
    pool = RawHttpPool(port, size=HB_CONNECTIONS)
    sim = Simulator(pool, "synthetic")
    procs = fab.processes()
    levels: list[Level] = []
    profiles: list[Profiler] = []
    runner = asyncio.create_task(sim.run())
    try:
        for n in steps:
            await sim.register(n - len(sim.ids))
            # Let the heartbeats that queued up behind the registrations drain, then let every
            # new instance beat once: the window measures the steady state of n instances.
            for _ in range(24):
                if sim.outstanding < HB_CONNECTIONS:
                    break
                await asyncio.sleep(0.25)
            await asyncio.sleep(1.5)
            level = Level(n)
            meter = CpuMeter({"cp": procs.pids(["omni-cp"]), "redis": procs.pids(["redis-server"])})
            prof = _profiler(opts, procs.pids(["omni-cp"]), n, window)
            meter.start()
            sim.level = level
            await asyncio.sleep(window)
            sim.level = None
            meter.stop()
            if prof is not None:
                prof.wait()
                profiles.append(prof)
            level.cp_cpu = meter.used["cp"] / meter.wall
            level.redis_cpu = meter.used["redis"] / meter.wall
            level.client_cpu = meter.used["client"] / meter.wall
            level.cp_waited = meter.waited["cp"] / meter.wall
            level.rate = len(level.latencies) / window
            levels.append(level)
            print(
                f"[control-plane] {n} instances: p99 {percentile(level.latencies, 99) * 1e3:.1f}"
                f" ms, errors {level.errors}, cp {level.cp_cpu:.0%}",
                flush=True,
            )
            if not level.holds:
                break
        burst = await _burst(port, sim.ids[:BURST])
    finally:
        await sim.stop()
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        await pool.close()
    report.notes.append(
        f"Burst probe: {BURST} heartbeats sent at once on {BURST} connections (as after a "
        f"control-plane restart): {burst.get(200, 0)} answered 200, "
        + ", ".join(f"{n} answered {k}" for k, n in sorted(burst.items()) if k != 200)
        + " (status 0: connection error or timeout). A 503 here reads 'control plane storage "
        "(redis) unavailable: Too many connections': redis-py's default asyncio pool holds "
        "100 connections and raises instead of waiting."
    )
    best = max((lv.instances for lv in levels if lv.holds), default=0)
    rows = [
        [
            fmt_num(lv.instances),
            fmt_num(lv.rate),
            fmt_ms(percentile(lv.latencies, 50), 1),
            fmt_ms(percentile(lv.latencies, 99), 1),
            str(lv.errors + lv.unhealthy),
            f"{lv.cp_cpu:.0%}",
            f"{lv.redis_cpu:.0%}",
            f"{lv.client_cpu:.0%}",
            f"{lv.cp_waited:.0%}",
            _verdict(lv),
        ]
        for lv in levels
    ]
    report.add(
        md_table(
            [
                "instances",
                "heartbeats/s",
                "p50 ms",
                "p99 ms",
                "errors",
                "omni-cp CPU",
                "redis CPU",
                "client CPU",
                "omni-cp waiting for a CPU",
                "holds",
            ],
            rows,
            title="Heartbeat capacity of one omni-cp + Redis (1 Hz per instance)",
            notes=(
                f"Window {window:g} s per level; latency from each heartbeat's scheduled time to "
                "its answer; CPU as a share of one core (this machine has 2, shared by omni-cp, "
                "Redis and the simulating client). Ramp stops at the first level that does not "
                "hold (p99 > 100 ms, an error or a non-healthy ack). 'waiting for a CPU': share "
                "of the window omni-cp was runnable but not running (schedstat), i.e. starved by "
                f"other processes. Sustained: {best:,}."
            ),
        )
    )
    for prof in profiles[-2:]:  # the last level that held and the one that did not
        report.add(prof.summaries())
    return best


async def _burst(port: int, ids: list[str]) -> dict[int, int]:
    """Open one connection per id, then send one heartbeat on each at the same moment; count
    the answers by status (0: connection error or timeout)."""
    conns = await asyncio.gather(
        *(asyncio.open_connection(LOCALHOST, port) for _ in ids), return_exceptions=True
    )
    counts: dict[int, int] = {}

    async def one(instance_id: str, conn: object) -> None:
        status = 0
        if isinstance(conn, tuple):
            path = f"/v1/instances/{instance_id}/heartbeat"
            head = (
                f"PUT {path} HTTP/1.1\r\nHost: {LOCALHOST}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(HB_BODY)}\r\n\r\n"
            ).encode()
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
                async with asyncio.timeout(5.0):
                    status, _ = await RawConn(*conn).request(head, HB_BODY)
        counts[status] = counts.get(status, 0) + 1

    try:
        await asyncio.gather(*(one(i, c) for i, c in zip(ids, conns, strict=True)))
    finally:
        for c in conns:
            if isinstance(c, tuple):
                c[1].close()
    return counts


def _profiler(opts: Options, pids: list[int], n: int, window: float) -> Profiler | None:
    if opts.profile_dir is None or not pids:
        return None
    prof = Profiler({f"omni-cp-heartbeats-{n}": pids[0]}, opts.profile_dir, window)
    return prof if prof.start() else None


def _verdict(lv: Level) -> str:
    if lv.holds:
        return "yes"
    return "**no**" + (f" ({lv.error_samples[0]})" if lv.error_samples else "")


# ---- 2. propagation ------------------------------------------------------------------------------


class _Changes:
    """Pool changes of stage 1 (register / deregister one instance) and when each watcher
    saw them."""

    def __init__(self, pool: RawHttpPool, watchers: int) -> None:
        self.pool = pool
        self.watchers = watchers
        self.instance_id = ""
        self.present = False
        self.t0 = 0.0
        self.seen: list[float] = []
        self.pending: set[int] = set()
        self.done = asyncio.Event()

    def listener(self, index: int) -> Callable[[PipelineSnapshot], None]:
        def on_change(snap: PipelineSnapshot) -> None:
            if index not in self.pending:
                return
            ids = {i.instance_id for i in snap.healthy(1)}
            if (self.instance_id in ids) == self.present:
                self.seen.append(time.monotonic() - self.t0)
                self.pending.discard(index)
                if not self.pending:
                    self.done.set()

        return on_change

    async def change(self, c: int) -> None:
        self.pending.update(range(self.watchers))
        self.done.clear()
        self.t0 = time.monotonic()
        if c % 2 == 0:
            body = {"pipeline": "synthetic", "stage_id": 1, "capacity": 8}
            body["address"] = f"http://127.0.0.{c % 200 + 2}:{20000 + c}"
            self.present = True
            status, data = await self.pool.request(
                "POST", "/v1/instances", json.dumps(body).encode()
            )
            if status == 201:
                self.instance_id = json.loads(data)["instance_id"]
        else:
            self.present = False
            status, _ = await self.pool.request("DELETE", f"/v1/instances/{self.instance_id}")
        if status not in (201, 204):
            raise RuntimeError(f"pool change {c}: HTTP {status}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), 5.0)
        self.seen.extend([math.inf] * len(self.pending))  # not seen within 5 s
        self.pending.clear()


async def propagation(opts: Options, fab: Fabric, report: Report) -> float:
    watchers_n = opts.pick(16, 8)
    changes = opts.pick(60, 16)
    background = 1000
    port = int(fab.cp_url.rsplit(":", 1)[1])
    pool = RawHttpPool(port, size=64)
    sim = Simulator(pool, "tiny-omni")
    await sim.register(background)
    runner = asyncio.create_task(sim.run())
    clients = [ControlPlaneClient(fab.cp_url) for _ in range(watchers_n)]
    watchers = [PoolWatcher(c, "synthetic") for c in clients]
    change_pool = RawHttpPool(port, size=1)
    track = _Changes(change_pool, watchers_n)
    try:
        for i, w in enumerate(watchers):
            w.add_listener(track.listener(i))
            await w.start()
        for c in range(changes):
            await track.change(c)
            await asyncio.sleep(0.05)
    finally:
        for w in watchers:
            await w.stop()
        for cl in clients:
            await cl.close()
        await change_pool.close()
        await sim.stop()
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        await pool.close()
    seen = track.seen
    p50, p99 = percentile(seen, 50), percentile(seen, 99)
    report.add(
        md_table(
            ["watchers", "pool changes", "samples", "p50 ms", "p99 ms", "max ms"],
            [
                [
                    str(watchers_n),
                    str(changes),
                    str(len(seen)),
                    fmt_ms(p50, 1),
                    fmt_ms(p99, 1),
                    fmt_ms(max(seen), 1),
                ]
            ],
            title="Pool-change propagation to watchers",
            notes=(
                "From sending the change (register / deregister an instance of stage 1) to each "
                "watcher's cached snapshot showing it; watchers are the sidecars' PoolWatcher "
                f"(long-poll /v1/watch), each with its own connection, in this process; "
                f"{background:,} instances of another pipeline heartbeat at 1 Hz meanwhile."
            ),
        )
    )
    return p99


# ---- 3. kill -9 ----------------------------------------------------------------------------------


def _addresses(fab: Fabric) -> list[str]:
    return fab.discovered(1)


async def _wait_gone(fab: Fabric, address: str, t_kill: float, limit: float) -> float:
    while time.monotonic() - t_kill < limit:
        addrs = await asyncio.to_thread(_addresses, fab)
        if address not in addrs:
            return time.monotonic() - t_kill
        await asyncio.sleep(0.01)
    return math.inf


def _ejected_at(pod: Pod, instance_id: str, after_wall: float) -> float:
    """Wall-clock time of stage 0's 'ejecting instance=<id>' log line (ms resolution)."""
    for line in pod.proc.stderr.splitlines():
        if "ejecting instance=" + instance_id not in line:
            continue
        try:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if stamp >= after_wall - 0.002:
            return stamp
    return math.nan


async def kill_replica(opts: Options, report: Report, rss: RssReport) -> tuple[float, float, float]:
    """Median seconds to leave omni-cp discovery without and with traffic, and to leave stage
    0's router with traffic."""
    reps = opts.repetitions(3, 1)
    lease_s = LEASE_S
    out: dict[str, list[float]] = {"idle": [], "traffic": []}
    ejects: list[float] = []
    errors = 0
    failovers: list[float] = []
    with Fabric("kill9") as fab:
        fab.start_cp()
        s0 = fab.add_stage(0, wait=False)
        for s in (1, 1, 2):
            fab.add_stage(s, wait=False)
        fab.wait_ready()
        fab.wait_discovered(1, 2)
        fab.wait_discovered(0, 1)
        fab.wait_discovered(2, 1)
        await asyncio.sleep(1.0)
        rss.idle = fab.processes().rss()
        for mode in ("idle", "traffic"):
            for _ in range(reps):
                victim = fab.stage_pods(1)[0]
                info = http_json(f"{fab.cp_url}/v1/pipelines/synthetic/stages/1/instances")
                rec = next(i for i in info["instances"] if i["address"] == victim.url)
                load_task = None
                if mode == "traffic":
                    fn = hop_caller(s0.url, 0, f"k9-{victim.pid}")
                    load_task = asyncio.create_task(
                        run_load(fn, concurrency=8, duration_s=lease_s + 3.0, warmup_s=1.0)
                    )
                    await asyncio.sleep(1.5)
                wall = time.time()
                t_kill = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL)
                gone = await _wait_gone(fab, victim.url, t_kill, lease_s + 10)
                out[mode].append(gone)
                if load_task is not None:
                    res = await load_task
                    errors += res.errors
                    failovers.append(max(res.latencies) if res.latencies else math.nan)
                    ejects.append(_ejected_at(s0, rec["instance_id"], wall) - wall)
                victim.proc.kill()
                fab.pods.remove(victim)
                fab.add_stage(1)
                fab.wait_discovered(1, 2)
                await asyncio.sleep(0.5)
        rss.loaded = fab.processes().rss()
    idle, traffic = median(out["idle"]), median(out["traffic"])
    eject = median(ejects) if ejects else math.nan
    rows = [
        ["no traffic", str(reps), fmt_ms(idle, 0), "-", "-", "-"],
        [
            "closed loop, 8 workers via stage 1",
            str(reps),
            fmt_ms(traffic, 0),
            fmt_ms(eject, 1),
            str(errors),
            fmt_ms(median(failovers), 1) if failovers else "-",
        ],
    ]
    report.add(
        md_table(
            [
                "case",
                "kills",
                "out of omni-cp discovery, ms",
                "out of stage 0's router, ms",
                "failed requests",
                "slowest request, ms",
            ],
            rows,
            title="kill -9 of a stage-1 replica",
            notes=(
                f"Lease {lease_s:g} s, heartbeats every 1 s, sweeper every 250 ms (defaults). "
                "'out of omni-cp discovery': polled every 10 ms on GET .../stages/1/instances. "
                "'out of stage 0's router': the 'ejecting instance=...' line stage 0 logs on the "
                "first refused connection (millisecond timestamps). Hops that hit the dead "
                "replica are replayed on the other one, so no request fails."
            ),
        )
    )
    return idle, traffic, eject


# ---- the benchmark -------------------------------------------------------------------------------


async def bench(opts: Options) -> Report:
    report = Report("control-plane", "control-plane: heartbeats, propagation, kill -9")
    rss = RssReport()
    with Fabric("cp-ramp") as fab:
        fab.start_cp()
        await asyncio.sleep(0.5)
        rss.idle = fab.processes().rss()
        best = await heartbeat_ramp(opts, fab, report)
        rss.loaded = fab.processes().rss()
    with Fabric("cp-watch") as fab:
        fab.start_cp()
        p99 = await propagation(opts, fab, report)
    report.add(rss.table("RSS of omni-cp and Redis (heartbeat ramp)"))
    kill_rss = RssReport()
    idle, traffic, eject = await kill_replica(opts, report, kill_rss)
    report.add(kill_rss.table("RSS of every process kind started (kill -9 topology)"))
    report.targets += [
        Target("instances at 1 Hz heartbeats on one omni-cp", best, 5000, True, "", _int),
        Target("pool-change propagation p99", p99 * 1e3, 100, False, "ms", _f1),
        Target("kill -9 -> out of omni-cp discovery, with traffic", traffic, 1.0, False, "s", _f2),
        Target("kill -9 -> out of stage 0's router, with traffic", eject, 1.0, False, "s", _f3),
        Target(
            "kill -9 -> out of omni-cp discovery, no traffic", idle, LEASE_S + 0.5, False, "s", _f2
        ),
    ]
    return report


def _int(v: float) -> str:
    return f"{v:,.0f}"


def _f1(v: float) -> str:
    return f"{v:.1f}"


def _f3(v: float) -> str:
    return f"{v:.3f}"


def _f2(v: float) -> str:
    return f"{v:.2f}"
