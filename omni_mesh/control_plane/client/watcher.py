"""``PoolWatcher``: a local, always-available cache of one pipeline's healthy pools.

A background loop long-polls ``/v1/watch`` with the version it holds. Each answer replaces the
cache; a new version also calls the change listeners. Each long-poll asks the server to answer
within ``resync_interval_s`` even when nothing changed, so a lost notification costs at most one
resync interval (DESIGN invariant 6). While the control plane is unreachable the watcher keeps
serving the last pools it knew (invariant 5) and retries with capped backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from omni_mesh.control_plane.client.backoff import Backoff
from omni_mesh.control_plane.client.http import ControlPlaneClient
from omni_mesh.control_plane.errors import ControlPlaneRequestError, ControlPlaneUnavailableError
from omni_mesh.control_plane.schema import InstanceInfo, PipelineSnapshot
from omni_mesh.control_plane.tasks import stop_task

logger = logging.getLogger(__name__)

ChangeListener = Callable[[PipelineSnapshot], None]


class PoolWatcher:
    """Cache of one pipeline's pools. ``await start()``, read ``healthy(stage)``, ``stop()``."""

    def __init__(
        self,
        client: ControlPlaneClient,
        pipeline: str,
        *,
        resync_interval_s: float = 10.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        on_change: ChangeListener | None = None,
    ) -> None:
        if resync_interval_s <= 0:
            raise ValueError("resync_interval_s must be positive")
        self.client = client
        self.pipeline = pipeline
        self.resync_interval_s = resync_interval_s
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._listeners: list[ChangeListener] = [] if on_change is None else [on_change]
        self.snapshot: PipelineSnapshot | None = None
        self.connected = False
        self.last_sync: float | None = None  # loop time of the last answer
        self._updated = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) when a new version arrives
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._down = False

    # ---- reading the cache ---------------------------------------------------------------

    @property
    def version(self) -> int:
        """Version of the cached snapshot; -1 before the first one."""
        return -1 if self.snapshot is None else self.snapshot.version

    def healthy(self, stage_id: int) -> tuple[InstanceInfo, ...]:
        """Healthy instances of one stage as last known (empty before the first snapshot)."""
        return () if self.snapshot is None else self.snapshot.healthy(stage_id)

    def add_listener(self, listener: ChangeListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: ChangeListener) -> None:
        self._listeners.remove(listener)

    async def wait_for(
        self,
        predicate: Callable[[PipelineSnapshot], bool],
        timeout: float,  # noqa: ASYNC109 - a helper's budget, not a cancellation scope
    ) -> PipelineSnapshot:
        """Wait until a snapshot satisfies ``predicate``; raises ``TimeoutError``."""
        async with asyncio.timeout(timeout):
            while True:
                updated = self._updated
                if self.snapshot is not None and predicate(self.snapshot):
                    return self.snapshot
                await updated.wait()

    async def wait_changed(self, timeout_s: float) -> bool:
        """Wait until a new version of the pools arrives (True) or ``timeout_s`` passes
        (False): how a hop waiting for an empty pool wakes up without polling."""
        changed = self._changed
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await changed.wait()
        except TimeoutError:
            return False
        return True

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Fetch the current snapshot once (logging, not raising, if that fails), then follow."""
        if self._task is not None:
            raise RuntimeError("PoolWatcher already started")
        try:
            self._apply(await self.client.watch(self.pipeline, None, timeout_s=0))
        except ControlPlaneUnavailableError as exc:
            self._disconnected(str(exc))
        self._task = asyncio.create_task(self._run(), name=f"omni-pool-watcher-{self.pipeline}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await stop_task(self._task, grace_s=0.0)
            self._task = None

    async def _run(self) -> None:
        while not self._stopping:
            since = None if self.snapshot is None else self.snapshot.version
            try:
                snapshot = await self.client.watch(
                    self.pipeline, since, timeout_s=self.resync_interval_s
                )
            except ControlPlaneUnavailableError as exc:
                self._disconnected(str(exc))
            except ControlPlaneRequestError as exc:
                self._disconnected(f"request refused: {exc}")
            else:
                self._apply(snapshot)
                continue
            await asyncio.sleep(self._backoff.next())

    def _disconnected(self, why: str) -> None:
        if not self._down:
            logger.warning(
                "pipeline=%s: watch failing, keeping the last known pools (version %d): %s",
                self.pipeline,
                self.version,
                why,
            )
        self._down = True
        self.connected = False

    def _apply(self, snapshot: PipelineSnapshot) -> None:
        changed = self.snapshot is None or snapshot.version != self.snapshot.version
        if self._down:
            logger.info(
                "pipeline=%s: watch recovered at version %d", self.pipeline, snapshot.version
            )
        self.snapshot = snapshot
        self._down = False
        self.connected = True
        self.last_sync = asyncio.get_running_loop().time()
        self._backoff.reset()
        updated, self._updated = self._updated, asyncio.Event()
        updated.set()
        if changed:
            changed_event, self._changed = self._changed, asyncio.Event()
            changed_event.set()
            logger.debug("pipeline=%s: pools at version %d", self.pipeline, snapshot.version)
            for listener in list(self._listeners):
                try:
                    listener(snapshot)
                except Exception:  # a listener's bug must not stop the watch loop
                    logger.exception("pipeline=%s: change listener failed", self.pipeline)
