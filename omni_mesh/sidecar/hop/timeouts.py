"""Timeouts that do not blame a peer for this process's own lateness.

A short timeout (a hop's 0.3 s connect, a liveness probe) is evidence against the peer only if
this event loop kept time while it ran. On a saturated host the loop itself can run late by
more than the timeout: the connection was made in the kernel long ago, but its callbacks had not
run yet when the timer fired. Failing the peer then ejects a live replica and replays its work
onto the others, which are just as loaded: a retry storm made by the fabric itself.

:func:`within` waits like ``asyncio.wait_for``, but when its window ends it checks how late the
loop was: a window that ended much later than it should have is not conclusive, and another
window starts (at most ``max_windows``; the caller's own deadline bounds the whole wait).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

#: A window that ended more than this late (or half the timeout, if larger) is inconclusive.
LATE_S = 0.05


async def within(aw: Awaitable[T], timeout_s: float, *, max_windows: int = 5) -> T:
    """``await aw`` within ``timeout_s`` of loop-kept time; ``TimeoutError`` otherwise.

    ``aw`` is cancelled on timeout and on cancellation of the caller."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(aw)
    try:
        for _ in range(max_windows):
            start = loop.time()
            done, _pending = await asyncio.wait({task}, timeout=timeout_s)
            if done:
                return task.result()
            late = loop.time() - start - timeout_s
            if late <= max(LATE_S, timeout_s / 2):
                break  # the loop kept time: the peer really did not answer
        raise TimeoutError
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
