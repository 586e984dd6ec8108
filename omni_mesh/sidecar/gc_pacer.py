"""The collector's full passes, moved off the serving path.

CPython's generation-2 collection scans every long-lived object. In a sidecar those are mostly
its open connections: with 1,500 client connections an API server holds ~63,000 such objects
and one full pass takes ~60 ms on this machine, during which nothing is answered (not even a
shed, which needs well under a millisecond). The young generations stay automatic (they scan
only what was allocated since the last pass: a fraction of a millisecond); the full passes
become this pacer's:

* **when idle** (nothing in flight at two ticks and nothing admitted between them, and at least
  ``idle_gap_s`` since the last pass), where a pause costs no one anything;
* **when busy for ``busy_pass_s``** (``--gc-busy-pass-s``; a pod that never goes idle must
  still free its cyclic garbage): one full pass, after which its survivors are frozen
  (``gc.freeze``). They survived a full pass, so they are long-lived (connections, the app);
  the next busy passes scan only what came after them, and cost what a young pass costs.
* Frozen objects are never collected, so garbage among them waits: the next idle moment
  unfreezes everything and runs a whole pass, and a pod busy for so long that the frozen set
  grows by ``frozen_cap`` objects does so at once (one pause, counted).

The young passes are paced too, while the pod is busy: one every ``young_pass_s``. CPython
triggers a young pass when allocations *minus deallocations* pass a threshold, and in a pod
whose work arrives as fast as it leaves (every queued request's objects replaced by a newer
one's) that difference stays small while the young generation grows: an API server holding
~800 queued requests was seen with 46,000 young objects (8,000 of them coroutines) at a pass
that took 8-11 ms, and such passes reached 50 ms. A young pass every ``young_pass_s`` (0.1 s)
scans only what arrived since the last one (about a millisecond), and moves it to the old
generation, which only the paced full passes scan.

Start-up objects are frozen once ready (:func:`freeze_startup_objects`), as before. Every pass,
automatic or paced, is timed into ``omni_process_gc_pause_seconds`` by generation; the paced
ones are counted by reason in ``omni_process_gc_paced_collections_total``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_mesh.observability.gc_metrics import ProcessGcMetrics

logger = logging.getLogger(__name__)

#: gen-2 threshold that never fires: counts gen-1 passes, ~30/s in a busy sidecar.
AUTOMATIC_FULL_OFF = 1 << 30


def freeze_startup_objects() -> None:
    """Collect once, then keep everything start-up made (modules, the app, the engine client)
    out of every later garbage collection: under load a collection otherwise re-scans them
    about once per 20 hops (~40% of the GC time per hop)."""
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class PacerSettings:
    tick_s: float = 0.5
    idle_gap_s: float = 5.0
    busy_pass_s: float = 60.0
    frozen_cap: int = 250_000
    young_pass_s: float = 0.1  # 0: young passes left to CPython's thresholds


class GcPauseTimer:
    """A ``gc.callbacks`` entry timing every pass into the pause histogram."""

    def __init__(self, metrics: ProcessGcMetrics) -> None:
        self._pause = [metrics.pause.labels(str(g)) for g in range(3)]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self._pause[info["generation"]].observe(time.perf_counter() - self._start)


class GcPacer:
    """Runs the full passes of this process's collector (see the module's docstring).

    ``activity`` gives the process's work now: (requests in flight or queued, requests admitted
    since start)."""

    def __init__(
        self,
        activity: Callable[[], tuple[int, int]],
        metrics: ProcessGcMetrics,
        settings: PacerSettings | None = None,
    ) -> None:
        self._activity = activity
        self._metrics = metrics
        self.settings = settings or PacerSettings()
        self._timer = GcPauseTimer(metrics)
        self._thresholds = gc.get_threshold()
        self._task: asyncio.Task[None] | None = None
        self._young_task: asyncio.Task[None] | None = None
        self._last_pass = time.monotonic()
        self._last_activity = (1, -1)  # (in flight or queued, admitted) at the last tick
        self._baseline = 0  # objects frozen by whole passes (start-up, idle)
        # Objects frozen now, counted after each freeze: ``gc.get_freeze_count()`` walks the
        # whole frozen list (3.11), 2 ms or more for a pod's ~70,000 start-up objects, which
        # a tick twice a second must not pay.
        self._frozen = 0
        self._young = metrics.paced.labels("young")

    def start(self) -> None:
        """Install the pacer and tick every ``tick_s`` (in the running loop)."""
        if self.install():
            self._task = asyncio.create_task(self._run(), name="gc-pacer")
            if self.settings.young_pass_s > 0:
                self._young_task = asyncio.create_task(self._run_young(), name="gc-young")

    def install(self) -> bool:
        """Freeze the start-up objects, time every pass and take full passes off automatic;
        False with ``busy_pass_s`` 0 (only timed: CPython runs them as it always does)."""
        freeze_startup_objects()
        self._baseline = self._frozen = gc.get_freeze_count()
        self._metrics.frozen.set(self._baseline)
        if self._timer not in gc.callbacks:
            gc.callbacks.append(self._timer)
        if self.settings.busy_pass_s <= 0:
            return False
        gc.set_threshold(self._thresholds[0], self._thresholds[1], AUTOMATIC_FULL_OFF)
        self._last_pass = time.monotonic()
        return True

    async def stop(self) -> None:
        for task in (self._task, self._young_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._young_task = None
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._timer)
        gc.set_threshold(*self._thresholds)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            self.tick(time.monotonic())

    async def _run_young(self) -> None:
        while True:
            await asyncio.sleep(self.settings.young_pass_s)
            self.young_tick()

    def young_tick(self) -> bool:
        """A young pass now if the pod has work in flight or queued (see the module's
        docstring); whether it ran."""
        if self._activity()[0] == 0:
            return False  # nothing held: requests' objects die young, CPython's passes do
        gc.collect(1)
        self._young.inc()
        return True

    def tick(self, now: float) -> str | None:
        """Take the pass that is due now, if any; the reason it was taken."""
        now_activity = self._activity()
        idle = now_activity == (0, self._last_activity[1]) and self._last_activity[0] == 0
        busy = not idle
        self._last_activity = now_activity
        grown = self._frozen - self._baseline
        since = now - self._last_pass
        if idle and grown > 0:
            reason = self._whole_pass("idle_unfreeze")
        elif idle and gc.get_count()[2] > 0 and since >= self.settings.idle_gap_s:
            reason = self._pass("idle", freeze=False)
        elif grown >= self.settings.frozen_cap:
            reason = self._whole_pass("frozen_cap")
        elif busy and since >= self.settings.busy_pass_s and gc.get_count()[2] > 0:
            reason = self._pass("busy", freeze=True)
        else:
            return None
        self._last_pass = now
        return reason

    def _pass(self, reason: str, *, freeze: bool) -> str:
        found = gc.collect(2)
        if freeze:
            gc.freeze()
            self._frozen = gc.get_freeze_count()  # after a full pass: one more O(n) is fine
        self._counted(reason, found)
        return reason

    def _whole_pass(self, reason: str) -> str:
        gc.unfreeze()
        found = gc.collect(2)
        gc.freeze()
        self._baseline = self._frozen = gc.get_freeze_count()
        self._counted(reason, found)
        return reason

    def _counted(self, reason: str, found: int) -> None:
        self._metrics.paced.labels(reason).inc()
        self._metrics.frozen.set(self._frozen)
        logger.debug("gc pass reason=%s unreachable=%d frozen=%d", reason, found, self._frozen)
