"""The sidecar's side of its co-located engine process.

Spawns ``python -m omni_mesh.engines``, runs the HELLO/READY handshake, submits requests with
their tensors in the sidecar's shared-memory arena, hands back each request's outputs as the
engine emits them (one whole output, or its chunks under ``async_chunk``), and turns a dead
engine into one typed :class:`EngineDeadError` for every waiter. Engine death is noticed at
once (the child's exit and the socket's EOF are both watched), its segments are unlinked, and
``on_death`` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import msgspec

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.data_plane.channel import AsyncChannel, ChannelError, Delivery, make_socketpair
from omni_mesh.data_plane.constants import ENGINE_TMP_ENV, INLINE_MAX, VISIBLE_DEVICES_ENV
from omni_mesh.data_plane.messages import (
    Abort,
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
    streams_out,
    transfer_key,
)
from omni_mesh.data_plane.shm import (
    ShmArena,
    ShmArenaFull,
    ShmReader,
    arena_budget,
    externalize,
    unlink_prefix,
)
from omni_mesh.observability.time_average import TimeAverage, WindowMean
from omni_mesh.procutil import die_with_parent
from omni_mesh.sidecar.engine_link.tmp_dirs import (
    make_engine_tmp,
    remove_engine_tmp,
    sweep_orphaned_engine_tmp,
)
from omni_mesh.sidecar.engine_link.work import EngineRun, Work

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process is gone; the pod must leave the pool and exit."""


class EngineBusyError(RuntimeError):
    """No room in shared memory for this request's inputs now; another replica may take it."""


class EngineStartError(RuntimeError):
    """The engine failed to start (load error or handshake timeout); ``config_error`` when its
    settings are unusable (the CLI exits 2: restarting cannot help)."""

    def __init__(self, message: str, *, config_error: bool = False) -> None:
        super().__init__(message)
        self.config_error = config_error


def visible_devices(stage_id: int, devices: tuple[int, ...], inherited: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine on ``devices``: the stage's device indices count
    within what this pod may see, so under an inherited mask (a batch scheduler's allocation,
    ``CUDA_VISIBLE_DEVICES=4,5``) they are mapped through it (device 1 is its second entry);
    without one they are the machine's own."""
    if not inherited:
        return ",".join(str(d) for d in devices)
    visible = [v.strip() for v in inherited.split(",") if v.strip()]
    past = [d for d in devices if d >= len(visible)]
    if past:
        raise EngineStartError(
            f"stage {stage_id}: devices {list(devices)} are indices within this pod's "
            f"{VISIBLE_DEVICES_ENV}={inherited!r} ({len(visible)} device(s)): "
            f"{past} is past it",
            config_error=True,
        )
    return ",".join(visible[d] for d in devices)


class EngineClient:
    """Owns one engine process and the shared memory between it and the sidecar."""

    def __init__(
        self,
        pipeline: str,
        stage_id: int,
        config: StageDeployConfig,
        *,
        devices: tuple[int, ...] | None = None,
        threads: int = 1,
        log_level: str = "INFO",
        async_chunk: bool = False,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.stage_id = stage_id
        self.config = config
        self.devices = devices  # the GPUs the engine may see; None: as this process does
        self.async_chunk = async_chunk
        self.threads = threads
        self.log_level = log_level
        self.on_death = on_death
        self.arena = ShmArena(max_total_bytes=arena_budget())  # inputs we write for the engine
        self.reader = ShmReader()  # engine output slots we read for inlining
        self.ready: Ready | None = None
        self.stats = Stats(queued=0, running=0, batch_size=0, step_ms=0.0, steps=0)
        self.engine_pid: int | None = None
        self.engine_prefix: str | None = None
        # The engine's own temp folder ($TMPDIR of its process): whatever it (or a library in
        # it: vLLM's vllm_dist_* files, torch's compile caches) leaves in it goes when it ends,
        # however it ends.
        self.engine_tmp: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._chan: AsyncChannel | None = None
        self._pending: dict[str, Work] = {}  # by transfer key
        # How many of them over time: the heartbeats' time-averaged occupancy (mean_in_flight).
        self._occupancy = TimeAverage()
        self._queue_waits = WindowMean()  # ms each request waited in the engine's queue
        self._submitted: dict[str, asyncio.Event] = {}  # keys a feeder waits to see submitted
        # Work left early, aborted on the engine: its input slots are reused (and its output
        # slots released) once its last Result says the engine let go of them.
        self._abandoned: dict[str, Work] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._channel_ended = asyncio.Event()  # EOF (or a broken frame) on the channel
        self._stopping = False
        self.dead = asyncio.Event()
        self.death_reason = ""

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self, timeout_s: float = 120.0) -> Ready:
        parent_sock, child_sock = make_socketpair()
        argv = [
            sys.executable,
            "-m",
            "omni_mesh.engines",
            "--pipeline",
            self.pipeline,
            "--stage-id",
            str(self.stage_id),
            "--channel-fd",
            str(child_sock.fileno()),
            "--config-json",
            self.config.model_dump_json(),
            "--peer-shm-prefix",
            self.arena.prefix,
            "--threads",
            str(self.threads),
            "--log-level",
            self.log_level,
            *(["--async-chunk"] if self.async_chunk else []),
        ]
        env = dict(os.environ)
        if self.devices is not None:  # its slice of the stage's devices, seen as cuda:0, …
            env[VISIBLE_DEVICES_ENV] = visible_devices(
                self.stage_id, self.devices, os.environ.get(VISIBLE_DEVICES_ENV)
            )
        sweep_orphaned_engine_tmp()  # those of pods killed with their engines
        self.engine_tmp = make_engine_tmp(self.stage_id)
        tmp = {"TMPDIR": self.engine_tmp, "TMP": self.engine_tmp, "TEMP": self.engine_tmp}
        tmp[ENGINE_TMP_ENV] = self.engine_tmp  # the engine removes it too (a killed sidecar)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                pass_fds=(child_sock.fileno(),),
                preexec_fn=die_with_parent(signal.SIGTERM),
                env={**env, **tmp},
            )
        except BaseException:
            self._remove_tmp()
            raise
        child_sock.close()
        self.engine_pid = self._proc.pid
        self._chan = await AsyncChannel.open(parent_sock)
        try:
            self.ready = await asyncio.wait_for(self._handshake(), timeout_s)
        except TimeoutError:
            await self._kill()
            await self._chan.close()
            raise EngineStartError(
                f"stage {self.stage_id}: engine not READY after {timeout_s:.0f}s "
                "(raise --engine-start-timeout)"
            ) from None
        except (EngineStartError, asyncio.CancelledError):  # nothing left running, nor its folder
            await self._kill()
            await self._chan.close()
            raise
        # Messages are handled in the channel's read callback: no receive task to wake.
        self._chan.listen(self._on_message)
        self._tasks = [asyncio.create_task(self._watch_process(), name="engine-wait")]
        logger.info(
            "engine ready stage=%d pid=%d engine=%s load=%.2fs",
            self.stage_id,
            self.engine_pid,
            self.ready.engine,
            self.ready.load_seconds,
        )
        return self.ready

    async def _handshake(self) -> Ready:
        assert self._chan is not None
        while True:
            msg = await self._chan.recv()
            if msg is None:
                raise EngineStartError(f"stage {self.stage_id}: engine exited during start-up")
            if isinstance(msg, Hello):
                self.engine_prefix = msg.shm_prefix
            elif isinstance(msg, Ready):
                return msg
            elif isinstance(msg, Fatal):
                raise EngineStartError(
                    f"stage {self.stage_id}: engine failed: {msg.message}",
                    config_error=msg.config_error,
                )

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to drain and exit; kill it if it does not."""
        self._stopping = True
        if self._proc is not None and self._proc.returncode is None and self._chan is not None:
            with contextlib.suppress(OSError, ConnectionError, ChannelError):
                await self._chan.send(Shutdown(drain=True))
            try:
                await asyncio.wait_for(self._proc.wait(), timeout_s)
            except TimeoutError:
                logger.warning(
                    "engine did not exit in %.0fs stage=%d: killing", timeout_s, self.stage_id
                )
                await self._kill()
        # Let the channel deliver what the engine sent before it exited (EOF ends it).
        if self._tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._channel_ended.wait(), 2.0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all("engine stopped")
        self._release_shm()
        if self._proc is not None and self._proc.returncode is not None:
            self._remove_tmp()
        if self._chan is not None:
            await self._chan.close()

    async def _kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
        self._release_shm()
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        """Remove the engine's temp folder (once its process has ended)."""
        if self.engine_tmp is not None:
            remove_engine_tmp(self.engine_tmp)
            self.engine_tmp = None

    def _release_shm(self) -> None:
        self.arena.close()
        self.reader.close()
        if self.engine_prefix:
            unlink_prefix(self.engine_prefix)

    # ---- background ----------------------------------------------------------------------

    async def _watch_process(self) -> None:
        assert self._proc is not None
        code = await self._proc.wait()
        self._remove_tmp()
        if not self._stopping:
            self._died(f"engine process exited with code {code}")

    def _on_message(self, msg: Delivery) -> None:
        """Every message from the engine after READY, as the channel reads it (nothing more
        is handled after a fatal error)."""
        if msg is None or isinstance(msg, ChannelError):
            self._channel_ended.set()
            if not self._stopping:
                self._died("engine closed its channel" if msg is None else f"channel: {msg}")
        elif self.dead.is_set():
            return
        elif isinstance(msg, Result):
            self._on_result(msg.key, msg.output)
        elif isinstance(msg, Results):
            for result in msg.results:
                self._on_result(result.key, result.output)
        elif isinstance(msg, Stats):
            self.stats = msg
        elif isinstance(msg, Fatal):
            self._died(f"engine fatal error: {msg.message}")

    def _on_result(self, key: str, out: StageOutput) -> None:
        work = self._pending.get(key)
        if work is not None and work.delivered == 0 and out.error is None:
            self._queue_waits.add(out.queue_ms)  # reported on a request's first output
        if work is None:
            abandoned = self._abandoned.get(key)
            if abandoned is None or abandoned.ends_with(out):
                self._abandoned.pop(key, None)
                self.arena.free_owner(key)  # the engine is done with our input slots
                self.release(key)  # and nobody will read its outputs
                if abandoned is not None and abandoned.on_aborted is not None:
                    abandoned.on_aborted("aborted")
            return
        if work.ends_with(out):
            work.answered = True
            del self._pending[key]
            self._occupancy.change(len(self._pending), time.monotonic())
            self.arena.free_owner(key)  # the engine is done with our input slots
        work.delivered += 1
        work.mailbox.put_nowait(out)

    def _died(self, reason: str) -> None:
        if self.dead.is_set():
            return
        self.death_reason = reason
        logger.error("engine died stage=%d pid=%s: %s", self.stage_id, self.engine_pid, reason)
        self.dead.set()
        self._fail_all(reason)
        self._release_shm()
        if self.on_death is not None:
            self.on_death(reason)

    def _fail_all(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        self._occupancy.change(0, time.monotonic())
        abandoned, self._abandoned = self._abandoned, {}
        for work in abandoned.values():
            if work.on_aborted is not None:
                work.on_aborted("engine_died")
        for work in pending.values():
            work.mailbox.put_nowait(EngineDeadError(f"stage {self.stage_id}: {reason}"))

    # ---- requests ------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Work handed to the engine whose last output has not come (running or queued
        there): this instant's count."""
        return len(self._pending)

    def mean_in_flight(self) -> float:
        """The engine's work in flight on average since the previous call: its integral over
        the interval divided by the interval (the pod's next heartbeat reads it, as
        ``occupancy``). Read at one instant, a short request is there at few instants."""
        return self._occupancy.take(time.monotonic())

    def mean_queue_wait_ms(self) -> float:
        """The mean time the requests that started since the previous call waited in the
        engine's queue (each request's first output says), ms; 0 when none started."""
        return self._queue_waits.take()

    def is_running(self, key: str) -> bool:
        """Whether the work named ``key`` (:func:`transfer_key`) is running here, or still
        being aborted (its last Result not back yet)."""
        return key in self._pending or key in self._abandoned

    def stream(self, si: StageInput) -> EngineRun:
        """Run one request on the engine; iterate its outputs as the engine emits them: one
        whole output, or its chunks in order (the last has ``last=True``; an error ends it).
        The request is submitted on the first ``__anext__``.

        The caller must :meth:`release` ``transfer_key(si)`` once it no longer needs the
        output tensors (they live in the engine's slots). Leaving early (``aclose``,
        cancellation) aborts the work on the engine and frees its input slots."""
        return EngineRun(self, si)

    async def submit(self, si: StageInput) -> tuple[str, Work]:
        """Hand ``si`` to the engine: its key and the work its outputs arrive in."""
        if self.dead.is_set() or self._stopping or self._chan is None:
            reason = self.death_reason or ("stopped" if self._stopping else "not started")
            raise EngineDeadError(f"stage {self.stage_id}: {reason}")
        key = transfer_key(si)
        if self.is_running(key):  # admission refuses duplicates; this is the last line
            raise EngineBusyError(f"stage {self.stage_id}: {key} is already running here")
        try:
            payload = externalize(si.payload, self.arena, key, threshold=INLINE_MAX)
        except ShmArenaFull as exc:
            raise EngineBusyError(f"stage {self.stage_id}: shared memory full: {exc}") from None
        si = msgspec.structs.replace(si, payload=payload)
        work = Work(whole=streams_out(si))
        self._pending[key] = work
        self._occupancy.change(len(self._pending), time.monotonic())
        try:
            await self._chan.send(Submit(stage_input=si))
        except ChannelError as exc:
            self.leave(key, work)
            # The engine is gone and the reader has not said so yet: the same answer as a
            # dead engine's (503, replayed by the sender), not an internal error.
            reason = self.death_reason or str(exc)
            raise EngineDeadError(f"stage {self.stage_id}: {reason}") from exc
        except BaseException:
            self.leave(key, work)
            raise
        waiting = self._submitted.get(key)  # a feeder of its streamed input
        if waiting is not None:
            waiting.set()
        return key, work

    def holds(self, key: str) -> bool:
        """Whether the work ``key`` was submitted and its last output has not come."""
        return key in self._pending

    async def submitted(self, key: str) -> None:
        """Return once the work ``key`` has been handed to the engine (a streamed input's later
        chunks must follow its first on the channel)."""
        if key in self._pending:
            return
        event = self._submitted.setdefault(key, asyncio.Event())
        try:
            await event.wait()
        finally:
            self._submitted.pop(key, None)

    async def feed(self, key: str, si: StageInput) -> None:
        """Hand the engine a later chunk of the streamed input of the work ``key`` (its
        tensors inline: chunks are a few positions each)."""
        if self.dead.is_set() or self._chan is None:
            raise EngineDeadError(f"stage {self.stage_id}: {self.death_reason or 'not started'}")
        try:
            await self._chan.send(Feed(key=key, stage_input=si))
        except ChannelError as exc:
            raise EngineDeadError(f"stage {self.stage_id}: {self.death_reason or exc}") from exc

    def fail(self, key: str, code: str, message: str) -> None:
        """End the running work ``key`` with an error output after those delivered, and abort
        it on the engine: what a streamed input that cannot be pulled comes to."""
        work = self._pending.get(key)
        if work is None:
            return
        error = StageError(code=code, message=message, stage_id=self.stage_id)  # type: ignore[arg-type]
        work.mailbox.put_nowait(
            StageOutput(request_id=key, stage_id=self.stage_id, chunk=work.delivered, error=error)
        )
        self.leave(key, work)

    def leave(self, key: str, work: Work) -> None:
        """The caller left before the last output (client gone, deadline, a failed branch)."""
        if self._pending.pop(key, None) is not None:
            self._occupancy.change(len(self._pending), time.monotonic())
        if self.dead.is_set() or self._chan is None:
            return  # its shared memory went with the engine
        if work.answered:  # the last output came but was not read: free what it holds
            self.release(key)
            return
        # Abort it on the engine, which answers with a last Result; only then are its input
        # slots reused (the engine may be reading them in the step it is running now).
        self._abandoned[key] = work
        self._send_soon(Abort(key=key))

    def when_aborted(self, key: str, callback: Callable[[str], None]) -> bool:
        """Call ``callback("aborted")`` once the engine has stopped the abandoned work ``key``
        (its last Result came back), or ``callback("engine_died")``; False (and no call) when
        no abort of ``key`` is outstanding."""
        work = self._abandoned.get(key)
        if work is None:
            return False
        work.on_aborted = callback
        return True

    def release(self, key: str) -> None:
        """The engine's output slots of the work ``key`` (:func:`transfer_key`) may be
        reused."""
        self._send_soon(Release(key=key))

    def _send_soon(self, msg: Abort | Release) -> None:
        if self._chan is None or self.dead.is_set():
            return
        task = asyncio.get_running_loop().create_task(self._send_quiet(msg))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _send_quiet(self, msg: Abort | Release) -> None:
        assert self._chan is not None
        with contextlib.suppress(OSError, ConnectionError, ChannelError):
            await self._chan.send(msg)
