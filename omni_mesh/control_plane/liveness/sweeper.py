"""The liveness sweeper: isolates instances whose lease lapsed and evicts long-dead records;
after each sweep it runs the autoscaling policy (``autoscaling/autoscaler.py``), so the lock
holder alone decides desired replica counts.

It runs in exactly one omni-cp at a time: the holder of a Redis lock (``SET NX PX``). Each tick
the holder's sweep script renews the lock and refuses to act if the lock is no longer the
holder's, so a paused or partitioned former holder cannot sweep. When the holder dies its lock
expires and another omni-cp takes over within ``sweeper_lock_ttl_ms``. A clean shutdown
releases the lock at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omni_mesh.control_plane.autoscaling.autoscaler import Autoscaler
from omni_mesh.control_plane.schema import REASON_LEASE_EXPIRED
from omni_mesh.control_plane.store.instances import InstanceStore, SweepResult
from omni_mesh.control_plane.tasks import stop_task
from omni_mesh.observability.metrics import ControlPlaneMetrics

logger = logging.getLogger(__name__)

_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


class Sweeper:
    """Background task: take the sweeper lock when free, sweep every ``interval_ms`` while held."""

    def __init__(
        self,
        store: InstanceStore,
        metrics: ControlPlaneMetrics,
        *,
        interval_ms: int,
        lock_ttl_ms: int,
        batch_limit: int = 512,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._interval_s = interval_ms / 1000
        self._lock_ttl_ms = lock_ttl_ms
        self._batch_limit = batch_limit
        self.token = f"{uuid.uuid4().hex}"
        self.is_leader = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._redis_down = False
        self._autoscaler = Autoscaler(store, store.scale, metrics.autoscale)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="omni-cp-sweeper")

    async def stop(self) -> None:
        """Stop ticking and release the lock if held (best effort)."""
        self._stopping.set()
        if self._task is not None:
            await stop_task(self._task, grace_s=2.0)  # let an in-flight tick finish
            self._task = None
        if self.is_leader:
            try:
                await self._store.release_sweeper_lock(self.token)
                logger.info("sweeper lock released token=%s", self.token[:8])
            except RedisError as exc:
                logger.warning("could not release the sweeper lock: %s", exc)
            self._set_leader(False)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.tick()
                if self._redis_down:
                    logger.info("sweeper: redis reachable again")
                self._redis_down = False
            except _REDIS_DOWN as exc:
                if not self._redis_down:
                    logger.warning("sweeper: redis unreachable (%s); retrying", exc)
                self._redis_down = True
                self._set_leader(False)
            except Exception:  # a bug must not stop liveness tracking: log it, keep ticking
                logger.exception("sweeper tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)

    async def tick(self) -> SweepResult:
        """One round: acquire the lock if free, then sweep if held."""
        if not self.is_leader and await self._store.try_acquire_sweeper_lock(
            self.token, self._lock_ttl_ms
        ):
            logger.info("sweeper lock acquired token=%s: this omni-cp sweeps", self.token[:8])
            self._set_leader(True)
        if not self.is_leader:
            return SweepResult(held_lock=False)
        started = time.perf_counter()
        result = await self._store.sweep(self.token, self._lock_ttl_ms, self._batch_limit)
        self._metrics.sweep_duration.observe(time.perf_counter() - started)
        if not result.held_lock:
            logger.warning("sweeper lock lost token=%s: another omni-cp sweeps", self.token[:8])
            self._set_leader(False)
        self._record(result)
        if result.held_lock:
            await self._autoscale()
        return result

    async def _autoscale(self) -> None:
        """Decide the autoscaled stages' desired counts (lock holder only, after its sweep)."""
        try:
            await self._autoscaler.tick(self.token)
        except _REDIS_DOWN:
            raise
        except Exception:  # a policy bug must not stop liveness tracking
            logger.exception("autoscale tick failed")

    def _record(self, result: SweepResult) -> None:
        for ev in result.events:
            labels = (ev.pipeline, str(ev.stage_id))
            if ev.kind == "expired":
                logger.warning(
                    "lease expired: isolating instance=%s pipeline=%s stage=%s was=%s",
                    ev.instance_id,
                    ev.pipeline,
                    ev.stage_id,
                    ev.previous_state,
                )
                self._metrics.lease_expiries.labels(*labels).inc()
                self._metrics.isolations.labels(*labels, REASON_LEASE_EXPIRED).inc()
            else:
                logger.info(
                    "evicted dead instance=%s pipeline=%s stage=%s",
                    ev.instance_id,
                    ev.pipeline,
                    ev.stage_id,
                )
                self._metrics.evictions.labels(*labels).inc()

    def _set_leader(self, leader: bool) -> None:
        self.is_leader = leader
        self._metrics.sweeper_leader.set(1 if leader else 0)
