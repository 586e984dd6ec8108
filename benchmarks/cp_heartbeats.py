"""control-plane, part 1 — heartbeat capacity of one ``omni-cp`` (with its embedded Redis).

Simulated instances (registered through ``POST /v1/instances``) each send
``PUT /v1/instances/{id}/heartbeat`` once a second, phases spread over the second, from this
process over a pool of keep-alive connections (:mod:`benchmarks.rawhttp`). The count is ramped;
a level holds when, over its window, heartbeat p99 (measured from each heartbeat's *scheduled*
time, so a client falling behind counts too) is at most 100 ms, nothing failed and every ack
said ``healthy``. The ramp stops at the first level that does not hold. :class:`Simulator` also
provides the background heartbeats of :mod:`benchmarks.cp_propagation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from dataclasses import dataclass, field

from benchmarks.common import Options, Report
from benchmarks.fabric import Fabric
from benchmarks.measure import CpuMeter, fmt_ms, fmt_num, md_table, percentile
from benchmarks.profiling import Profiler
from benchmarks.rawhttp import LOCALHOST, RawConn, RawHttpError, RawHttpPool

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
