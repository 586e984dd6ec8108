"""EngineProc: the engine process around :class:`EngineCore`.

It owns the control channel to its sidecar (a Unix socket: headers and wake-ups only), the
shared-memory arena its outputs are written into, and the process's shutdown. Tensors never go
through the socket except tiny ones (≤ ``INLINE_MAX`` bytes) carried inline in the header.

Shutdown states: RUNNING → DRAINING (Shutdown received: finish queued work) → STOPPED.
If the sidecar disappears (EOF on the socket, or SIGTERM from PDEATHSIG) the engine unlinks its
own segments *and* its sidecar's, then exits: no ``/dev/shm`` segment survives either death.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import signal
import threading
import time
from typing import Any

import numpy as np

from omni_mesh.data_plane.channel import BlockingChannel
from omni_mesh.data_plane.messages import (
    Abort,
    Fatal,
    Hello,
    Ready,
    Release,
    Result,
    Shutdown,
    StageError,
    StageInput,
    StageOutput,
    Stats,
    Submit,
    Tensor,
)
from omni_mesh.data_plane.shm import (
    ShmArena,
    ShmArenaFull,
    ShmReader,
    arena_budget,
    unlink_prefix,
)
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import EngineContext, OutputCapacityError
from omni_mesh.engines.core import EngineCore

logger = logging.getLogger(__name__)

INLINE_MAX = 4096
STATS_INTERVAL_S = 0.5


class State(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class EngineProc:
    """Receive → batch → execute → emit, until told to stop or orphaned."""

    def __init__(
        self,
        ctx: EngineContext,
        channel: BlockingChannel,
        *,
        peer_shm_prefix: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.channel = channel
        self.peer_shm_prefix = peer_shm_prefix
        self.max_num_seqs = max(1, ctx.config.max_num_seqs)
        self.arena = ShmArena(max_total_bytes=arena_budget())
        self.reader = ShmReader()
        self.state = State.RUNNING
        self._inbox: queue.Queue[tuple[StageInput, float] | None] = queue.Queue()
        self._aborted: set[str] = set()
        self._live: set[str] = set()  # submitted and not yet answered or dropped
        self._lock = threading.Lock()
        self._steps = 0
        self._last_step_ms = 0.0
        self._last_batch = 0
        self._cleaned = False

    # ---- lifecycle -----------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the sidecar decides when we stop
        signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self.channel.send(Hello(pid=os.getpid(), shm_prefix=self.arena.prefix))
            t0 = time.monotonic()
            try:
                core = EngineCore.build(self.ctx)
                core.engine.load()
            except Exception as exc:  # a load failure is reported, then fatal
                logger.exception("engine load failed stage=%d", self.ctx.stage.stage_id)
                self.channel.send(Fatal(message=f"{type(exc).__name__}: {exc}"))
                return 1
            self.channel.send(
                Ready(
                    engine=self.ctx.stage.engine,
                    max_num_seqs=self.max_num_seqs,
                    load_seconds=time.monotonic() - t0,
                )
            )
            threading.Thread(target=self._receive_loop, name="engine-rx", daemon=True).start()
            self._serve(core)
            core.engine.close()
            return 0
        finally:
            self._cleanup()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        logger.info("engine got SIGTERM stage=%d: exiting", self.ctx.stage.stage_id)
        self._orphaned()

    def _orphaned(self) -> None:
        """The sidecar is gone: free everything we and it held, and exit now."""
        self._cleanup()
        if self.peer_shm_prefix:
            unlink_prefix(self.peer_shm_prefix)
        os._exit(0)

    def _cleanup(self) -> None:
        with self._lock:
            if self._cleaned:
                return
            self._cleaned = True
        self.arena.close()
        self.reader.close()

    # ---- receive side --------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while True:
            msg = self.channel.recv()
            if msg is None:
                logger.warning("sidecar closed the channel stage=%d", self.ctx.stage.stage_id)
                self._orphaned()
                return
            if isinstance(msg, Submit):
                with self._lock:
                    self._live.add(msg.stage_input.request_id)
                self._inbox.put((msg.stage_input, time.monotonic()))
            elif isinstance(msg, Abort):
                with self._lock:
                    # An Abort that crossed its Result on the wire is for nothing live: ignore
                    # it, or it would swallow a later resubmission of the same request.
                    if msg.request_id in self._live:
                        self._aborted.add(msg.request_id)
            elif isinstance(msg, Release):
                self.arena.free_owner(msg.request_id)
            elif isinstance(msg, Shutdown):
                self.state = State.DRAINING
                self._inbox.put(None)
            else:
                logger.warning("unexpected message from sidecar: %s", type(msg).__name__)

    # ---- busy loop -----------------------------------------------------------------------

    def _serve(self, core: EngineCore) -> None:
        last_stats = 0.0
        while self.state is not State.STOPPED:
            # 1) Poll the input queue: block for the first item, then take what is ready.
            batch = self._next_batch()
            # 2) Drop what was aborted or expired while it waited.
            batch = self._admit(batch)
            # 3) Step the engine core and emit the outputs.
            if batch:
                t0 = time.monotonic()
                outputs = core.step(batch, self._read, self._write)
                self._last_step_ms = (time.monotonic() - t0) * 1000.0
                self._last_batch = len(batch)
                self._steps += 1
                self._emit(outputs)
            # 4) Report load now and then (not per step: that would double the IPC per request).
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                last_stats = now
                self.reader.prune()  # mappings of segments their owners unlinked
                self.channel.send(
                    Stats(
                        queued=self._inbox.qsize(),
                        running=len(batch),
                        batch_size=self._last_batch,
                        step_ms=self._last_step_ms,
                        steps=self._steps,
                    )
                )
            if self.state is State.DRAINING and self._inbox.empty():
                self.state = State.STOPPED

    def _next_batch(self) -> list[tuple[StageInput, float]]:
        batch: list[tuple[StageInput, float]] = []
        try:
            item = self._inbox.get(timeout=STATS_INTERVAL_S)
        except queue.Empty:
            return batch
        while True:
            if item is not None:
                batch.append(item)
            if len(batch) >= self.max_num_seqs:
                return batch
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return batch

    def _admit(self, batch: list[tuple[StageInput, float]]) -> list[tuple[StageInput, float]]:
        now_ms = time.time() * 1000.0
        admitted = []
        for si, t in batch:
            with self._lock:
                aborted = si.request_id in self._aborted
                self._aborted.discard(si.request_id)
                if aborted:
                    self._live.discard(si.request_id)
            if aborted:  # the sidecar no longer waits for it
                logger.info("dropping aborted request_id=%s stage=%d", si.request_id, self.stage_id)
            elif si.deadline_ms < now_ms:  # the sidecar waits: answer with the reason
                logger.info("deadline passed request_id=%s stage=%d", si.request_id, self.stage_id)
                self._emit([self._deadline_error(si)])
            else:
                admitted.append((si, t))
        return admitted

    @property
    def stage_id(self) -> int:
        return self.ctx.stage.stage_id

    def _deadline_error(self, si: StageInput) -> StageOutput:
        return StageOutput(
            request_id=si.request_id,
            stage_id=self.stage_id,
            error=StageError(
                code="deadline",
                message="the request's deadline passed while it waited for the engine",
                stage_id=self.stage_id,
            ),
        )

    def _emit(self, outputs: list[StageOutput]) -> None:
        for out in outputs:
            with self._lock:
                aborted = out.request_id in self._aborted
                self._aborted.discard(out.request_id)
                self._live.discard(out.request_id)
            if aborted:  # nobody waits for it: free its slots at once
                self.arena.free_owner(out.request_id)
                continue
            self.channel.send(Result(output=out))

    # ---- tensors -------------------------------------------------------------------------

    def _read(self, t: Tensor) -> np.ndarray:
        return array_from_tensor(t, self.reader)

    def _write(self, arr: np.ndarray, owner: str) -> Tensor:
        arr = np.ascontiguousarray(arr)
        if arr.nbytes <= INLINE_MAX:
            return tensor_from_array(arr.copy())
        try:
            slot = self.arena.alloc(arr.nbytes, owner)
        except ShmArenaFull as exc:
            raise OutputCapacityError(
                f"stage {self.stage_id}: shared memory for outputs is full ({exc}); "
                "retry later or give the pod a larger /dev/shm"
            ) from None
        dst = np.frombuffer(slot.view, dtype=np.uint8, count=arr.nbytes)
        dst[:] = arr.reshape(-1).view(np.uint8)
        return Tensor(dtype=str(arr.dtype), shape=tuple(arr.shape), shm=slot.ref)
