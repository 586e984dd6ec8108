"""control-plane, part 2 — how fast pool changes reach watchers.

Watchers (the sidecars' own :class:`PoolWatcher`, each with its own client) follow the
``synthetic`` pipeline while instances of it register and deregister; the time from the change
request to each watcher's snapshot showing it, while 1,000 simulated instances of another
pipeline heartbeat in the background (:class:`benchmarks.cp_heartbeats.Simulator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable

from benchmarks.common import Options, Report
from benchmarks.cp_heartbeats import Simulator
from benchmarks.fabric import Fabric
from benchmarks.measure import fmt_ms, md_table, percentile
from benchmarks.rawhttp import RawHttpPool
from omni_mesh.control_plane.client import ControlPlaneClient, PipelineSnapshot, PoolWatcher


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
