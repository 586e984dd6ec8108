"""Stopping background tasks reliably.

A cancellation that arrives while a library call is in flight can be swallowed by that library
(redis-py's timeouts, for one), leaving a loop that never ends and a shutdown that hangs. So
each loop also checks a stop flag, and :func:`stop_task` first lets the loop notice the flag,
then cancels, and never waits unboundedly.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


async def stop_task(
    task: asyncio.Task[None], *, grace_s: float, cancel_wait_s: float = 2.0
) -> None:
    """Wait up to ``grace_s`` for ``task`` to end by itself, then cancel it (bounded wait)."""
    if task.done():
        return
    done, _ = await asyncio.wait({task}, timeout=grace_s)
    if not done:
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=cancel_wait_s)
        if not done:
            logger.error("task %s did not stop within %.1fs", task.get_name(), cancel_wait_s)
            return
    if not task.cancelled() and task.exception() is not None:
        logger.error("task %s failed: %r", task.get_name(), task.exception())
