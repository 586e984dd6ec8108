"""What the autoscaling tests against a real omni-cp share."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from omni_mesh.control_plane.client import ControlPlaneClient, LoadReport, ScaleStatus


async def until(
    check: Callable[[], Awaitable[ScaleStatus]],
    ok: Callable[[ScaleStatus], bool],
    within_s: float = 30.0,
) -> ScaleStatus:
    """The first status ``check`` reads that ``ok`` accepts, polled every 50 ms."""
    deadline = time.monotonic() + within_s
    while True:
        status = await check()
        if ok(status):
            return status
        assert time.monotonic() < deadline, f"condition not met; last status: {status}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def heartbeating(
    client: ControlPlaneClient, reports: Callable[[], dict[str, LoadReport]]
) -> AsyncIterator[None]:
    """Each registered instance of ``reports()`` (instance id → its load now) heartbeats every
    200 ms until the block ends; then they leave."""
    ids = list(reports())

    async def beat() -> None:
        while True:
            for instance_id, report in reports().items():
                await client.heartbeat(instance_id, report)
            await asyncio.sleep(0.2)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for instance_id in ids:
            await client.deregister(instance_id)
