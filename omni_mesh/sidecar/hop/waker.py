"""Waking a stage scaled to zero: while hops wait for a stage whose pool is empty, the pod posts
``POST …/stages/{s}/scale/wake {"waiting": N}`` to the control plane, at most once every
``every_s`` per stage (the control plane keeps the hint 10 s, or until the stage has a ready
replica: a hop that keeps waiting keeps re-posting it). The autoscaling policy then asks for
at least one replica at once, and the actuator (omni-up, KEDA) starts it; the hop waits within
its deadline until the replica joins the pool (docs/operations.md, "Autoscaling"). A stage
that is not autoscaled ignores the hint.

:class:`StageWaker` is the hop client's ``on_empty_pool`` callback: synchronous and cheap,
the posts run as background tasks that :meth:`StageWaker.close` cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    ControlPlaneError,
    ControlPlaneRequestError,
)

logger = logging.getLogger(__name__)

WAKE_EVERY_S = 2.0


class StageWaker:
    """Posts rate-limited wake hints for stages that hops wait on with an empty pool."""

    def __init__(
        self, client: ControlPlaneClient, pipeline: str, *, every_s: float = WAKE_EVERY_S
    ) -> None:
        self._client = client
        self._pipeline = pipeline
        self.every_s = every_s
        self._last: dict[int, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self, stage_id: int, waiting: int) -> None:
        """``waiting`` hops wait for ``stage_id``, whose pool is empty."""
        now = time.monotonic()
        if now - self._last.get(stage_id, -math.inf) < self.every_s:
            return
        self._last[stage_id] = now
        task = asyncio.get_running_loop().create_task(
            self._wake(stage_id, max(1, waiting)), name=f"wake-stage-{stage_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wake(self, stage_id: int, waiting: int) -> None:
        try:
            status = await self._client.wake_stage(self._pipeline, stage_id, waiting)
        except ControlPlaneRequestError as exc:  # 404: not autoscaled, the pool just starts
            logger.debug("no wake for pipeline=%s stage=%d: %s", self._pipeline, stage_id, exc)
            return
        except ControlPlaneError as exc:
            logger.warning(
                "cannot wake pipeline=%s stage=%d (waiting=%d): %s",
                self._pipeline,
                stage_id,
                waiting,
                exc,
            )
            return
        level = logging.INFO if status.policy is not None else logging.DEBUG
        logger.log(
            level,
            "woke pipeline=%s stage=%d waiting=%d: desired=%s ready=%d",
            self._pipeline,
            stage_id,
            waiting,
            status.desired,
            status.ready,
        )

    async def close(self) -> None:
        """Cancel the posts still running."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
