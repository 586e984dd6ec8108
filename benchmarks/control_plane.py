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

The three parts live in :mod:`benchmarks.cp_heartbeats`, :mod:`benchmarks.cp_propagation` and
:mod:`benchmarks.cp_kill9`; :func:`bench` runs them in that order and collects the targets.
"""

from __future__ import annotations

import asyncio

from benchmarks.common import Options, Report
from benchmarks.cp_heartbeats import heartbeat_ramp
from benchmarks.cp_kill9 import LEASE_S, kill_replica
from benchmarks.cp_propagation import propagation
from benchmarks.fabric import Fabric
from benchmarks.measure import RssReport, Target


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
