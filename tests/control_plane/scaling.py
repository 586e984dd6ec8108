"""What the autoscaling tests against a real omni-cp share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from omni_mesh.control_plane.client import ScaleStatus


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
