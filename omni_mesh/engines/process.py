"""EngineProc: the engine process around :class:`EngineCore`.

It owns the control channel to its sidecar (a Unix socket: headers and wake-ups only), the
shared-memory arena its outputs are written into, and the process's shutdown. Tensors never go
through the socket except tiny ones (≤ ``INLINE_MAX`` bytes) carried inline in the header.

Shutdown states: RUNNING → DRAINING (Shutdown received: finish queued work and running
streams) → STOPPED.

With streams (``async_chunk``) a request may stay in the engine core for several steps, sending
one Result per chunk; running streams count against ``max_num_seqs``, and the loop only peeks
at the channel while any runs. Work is named by the input's ``transfer_key`` (the request id for
a whole input, ``request/chunk`` for a chunk of an upstream stream): Results carry it, Abort
and Release name it, and every output tensor of the work (all of a stream's chunks) is owned
by it in the arena until the sidecar's Release.
If the sidecar disappears (EOF on the socket, or SIGTERM from PDEATHSIG) the engine unlinks its
own segments *and* its sidecar's, then exits: no ``/dev/shm`` segment survives either death.
"""

from __future__ import annotations

import enum
import gc
import logging
import os
import shutil
import signal
import time
from collections import deque
from typing import Any

import numpy as np

from omni_mesh.data_plane.channel import BlockingChannel
from omni_mesh.data_plane.constants import ENGINE_TMP_ENV, INLINE_MAX
from omni_mesh.data_plane.messages import (
    Abort,
    EngineMessage,
    Fatal,
    Feed,
    Hello,
    Ready,
    Release,
    Result,
    Results,
    Shutdown,
    StageError,
    StageInput,
    StageOutput,
    Stats,
    Submit,
    Tensor,
    transfer_key,
)
from omni_mesh.data_plane.shm import (
    ShmArena,
    ShmArenaFull,
    ShmReader,
    arena_budget,
    unlink_prefix,
)
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import EngineConfigError, EngineContext, OutputCapacityError
from omni_mesh.engines.core import EngineCore

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
#: The longest wait on the channel while every running stream waits for its streamed input
#: (a Feed wakes the loop at once; the bound keeps deadlines and stats on time).
STARVED_POLL_S = 0.05


def _limit_torch_threads(engine: object, threads: int) -> None:
    """torch's intra-op threads, set before the engine loads. An engine class that says it
    does not use torch (``uses_torch = False``: the synthetic engine, numpy only) never loads
    it: ~150 MB less per idle engine process."""
    if getattr(type(engine), "uses_torch", True):
        import torch  # here, not at the top: engines without torch never pay for it

        torch.set_num_threads(threads)


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
        torch_threads: int = 1,
    ) -> None:
        self.ctx = ctx
        self.channel = channel
        self.peer_shm_prefix = peer_shm_prefix
        self.torch_threads = max(1, torch_threads)
        self.max_num_seqs = max(1, ctx.config.max_num_seqs)
        self.arena = ShmArena(max_total_bytes=arena_budget())
        self.reader = ShmReader()
        self.state = State.RUNNING
        self._waiting: deque[tuple[StageInput, float]] = deque()
        self._core: EngineCore | None = None
        self._steps = 0
        self._last_step_ms = 0.0
        self._busy_ms = 0.0  # every step's time since the start (Stats.busy_ms)
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
                _limit_torch_threads(core.engine, self.torch_threads)
                core.engine.load()
            except EngineConfigError as exc:  # bad settings: one line, no traceback
                logger.error("engine settings rejected stage=%d: %s", self.stage_id, exc)
                self.channel.send(Fatal(message=str(exc), config_error=True))
                return 1
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
            self._core = core
            gc.collect()
            gc.freeze()  # what loading made stays out of every later collection (hot loop)
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
        remove_own_tmp()
        os._exit(0)

    def _cleanup(self) -> None:
        if self._cleaned:  # one thread: a flag suffices (a lock could deadlock a signal handler)
            return
        self._cleaned = True
        self.arena.close()
        self.reader.close()

    # ---- receive side --------------------------------------------------------------------

    def _poll(self, timeout: float) -> None:
        """Take every message the sidecar sent; wait up to ``timeout`` for the first one."""
        if timeout > 0.0 or self.channel.ready():
            try:
                msg = self.channel.recv(timeout=timeout)
            except TimeoutError:
                return
            while True:
                if msg is None:
                    logger.warning("sidecar closed the channel stage=%d", self.stage_id)
                    self._orphaned()
                    return
                self._handle(msg)
                if not self.channel.ready():
                    return
                try:  # (no wait: the bytes ready may be part of a frame still on its way)
                    msg = self.channel.recv(timeout=0.0)
                except TimeoutError:
                    return

    def _handle(self, msg: EngineMessage) -> None:
        if isinstance(msg, Submit):
            self._waiting.append((msg.stage_input, time.monotonic()))
        elif isinstance(msg, Feed):
            # Kept for its request when that is running or still queued; dropped when it
            # ended (a talker that stopped before the thinker) or was aborted.
            queued = any(transfer_key(w[0]) == msg.key for w in self._waiting)
            if self._core is not None:
                self._core.feed(msg.key, msg.stage_input, self._read, queued=queued)
        elif isinstance(msg, Abort):
            # Waiting work is dropped and a running stream closed, each answered with a last
            # "aborted" Result: only then does the sidecar reuse the work's input slots. Work
            # already answered (its Abort crossed the last Result on the wire) is left alone,
            # so a later resubmission is not swallowed.
            dropped = [w[0] for w in self._waiting if transfer_key(w[0]) == msg.key]
            self._waiting = deque(w for w in self._waiting if transfer_key(w[0]) != msg.key)
            if self._core is not None and dropped:
                self._core.forget(msg.key)
            closed = self._core.abort(msg.key) if self._core is not None else None
            for si in [*dropped, *([closed] if closed is not None else [])]:
                logger.info("aborted key=%s stage=%d", msg.key, self.stage_id)
                self.channel.send(Result(output=self._aborted(si), key=msg.key))
        elif isinstance(msg, Release):
            self.arena.free_owner(msg.key)
        elif isinstance(msg, Shutdown):
            self.state = State.DRAINING
        else:
            logger.warning("unexpected message from sidecar: %s", type(msg).__name__)

    # ---- busy loop -----------------------------------------------------------------------

    def _serve(self, core: EngineCore) -> None:
        """One thread, no queue hand-offs: the channel is polled between steps."""
        last_stats = 0.0
        while self.state is not State.STOPPED:
            # 1) Poll the channel: block while idle, only peek while work waits or streams run
            #    (and wait a little while every running stream waits for its streamed input).
            self._poll(self._poll_timeout(core))
            # 2) Take a batch (room left beside the running streams), answering what expired.
            batch = self._next_batch(self.max_num_seqs - core.running)
            # 3) Step the engine core (new batch + one chunk of every stream), emit the outputs.
            if batch or core.running:
                t0 = time.monotonic()
                advanced = len(batch) + core.running
                outputs = core.advance(batch, self._read, self._write)
                self._last_step_ms = (time.monotonic() - t0) * 1000.0
                self._busy_ms += self._last_step_ms
                self._last_batch = advanced
                self._steps += 1
                if len(outputs) == 1:
                    si, out = outputs[0]
                    self.channel.send(Result(output=out, key=transfer_key(si)))
                elif outputs:  # the step's outputs in one frame
                    results = [Result(output=out, key=transfer_key(si)) for si, out in outputs]
                    self.channel.send(Results(results=results))
            else:
                core.engine.idle()  # nothing to run: the engine's own housekeeping
            # 4) Report load now and then (not per step: that would double the IPC per request).
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                last_stats = now
                self.reader.prune()  # mappings of segments their owners unlinked
                self.channel.send(
                    Stats(
                        queued=len(self._waiting),
                        running=core.running,
                        batch_size=self._last_batch,
                        step_ms=self._last_step_ms,
                        steps=self._steps,
                        engine=core.engine.stats(),
                        step_audio_s=core.engine.step_audio_s,
                        busy_ms=self._busy_ms,
                    )
                )
            if (
                self.state is State.DRAINING
                and not self._waiting
                and not core.running
                and not core.engine.holds_work()
            ):
                self.state = State.STOPPED

    def _poll_timeout(self, core: EngineCore) -> float:
        if self._waiting and core.running < self.max_num_seqs:
            return 0.0  # work to admit
        if core.running:
            return STARVED_POLL_S if core.engine.waits_for_input() else 0.0
        return STATS_INTERVAL_S

    def _next_batch(self, room: int) -> list[tuple[StageInput, float]]:
        """Up to ``room`` waiting inputs, oldest first; expired ones are answered instead."""
        now_ms = time.time() * 1000.0
        batch: list[tuple[StageInput, float]] = []
        while self._waiting and len(batch) < room:
            si, t = self._waiting.popleft()
            if si.deadline_ms < now_ms:  # the sidecar waits: answer with the reason
                logger.info("deadline passed request_id=%s stage=%d", si.request_id, self.stage_id)
                if self._core is not None:
                    self._core.forget(transfer_key(si))
                self.channel.send(Result(output=self._deadline_error(si), key=transfer_key(si)))
            else:
                batch.append((si, t))
        return batch

    @property
    def stage_id(self) -> int:
        return self.ctx.stage.stage_id

    def _deadline_error(self, si: StageInput) -> StageOutput:
        message = "the request's deadline passed while it waited for the engine"
        return self._failed(si, "deadline", message)

    def _aborted(self, si: StageInput) -> StageOutput:
        return self._failed(si, "aborted", "aborted by the sidecar")

    def _failed(self, si: StageInput, code: str, message: str) -> StageOutput:
        return StageOutput(
            request_id=si.request_id,
            stage_id=self.stage_id,
            chunk=si.chunk,
            error=StageError(code=code, message=message, stage_id=self.stage_id),  # type: ignore[arg-type]
        )

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


def remove_own_tmp() -> None:
    """Remove the temp folder the sidecar made for this engine (``ENGINE_TMP_ENV``), with
    whatever the engine's libraries left in it."""
    folder = os.environ.get(ENGINE_TMP_ENV)
    if folder and os.path.basename(folder).startswith("omni-engine-"):
        shutil.rmtree(folder, ignore_errors=True)
