"""control-plane, part 3 — how fast a replica killed with ``kill -9`` leaves discovery.

A real ``synthetic`` 1:2:1 topology; SIGKILL to the sidecar of one stage-1 replica (its engine
follows by PDEATHSIG), then the time until the control plane's discovery
(``GET …/stages/1/instances``) no longer lists it — with no traffic, and with a closed loop of
requests flowing through stage 1 (where stage 0's router also ejects it on the first refused
connection: that moment is read from stage 0's log).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from datetime import datetime
from statistics import median

from benchmarks.common import Options, Report, hop_caller
from benchmarks.fabric import Fabric, Pod, http_json
from benchmarks.load import run_load
from benchmarks.measure import RssReport, fmt_ms, md_table

LEASE_S = 3.0  # omni-cp's default lease (--lease-ttl-ms 3000), which the benchmark keeps


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
