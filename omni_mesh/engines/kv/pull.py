"""One pull of a prefill's held state (``exchange.py``): its remote agent being added (on the
exchange's connecting thread), then its NIXL read in flight, polled by the engine's batch once a
step (the row's ``RemotePrefill``)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NoReturn, Protocol

from torch import Tensor

from omni_mesh.data_plane.kv_transfer import KvTransferError
from omni_mesh.engines.kv.arena import SlotAllocator
from omni_mesh.engines.kv.counts import KvCounts
from omni_mesh.engines.kv.params import TAG, Entry

logger = logging.getLogger(__name__)


class PullSite(Protocol):
    """What a pull needs of the exchange that started it (:class:`~.exchange.KvExchange`):
    its NIXL agent, receive slots, counters and bookkeeping of reads and peers."""

    pull_timeout_s: float
    counts: KvCounts
    receive: SlotAllocator

    @property
    def agent(self) -> Any: ...

    def begin_read(self, pull: KvPull) -> Any: ...

    def forget(self, remote: str) -> None: ...

    def drain(self, pull: KvPull) -> None: ...

    def read_ended(self, remote: str) -> None: ...

    def release_handle(self, handle: Any) -> None: ...

    def cool(self, allocator: SlotAllocator, offset: int) -> None: ...

    def tensors_at(self, offset: int, entries: list[Entry]) -> dict[str, Tensor]: ...


class KvPull:
    """One pull (:meth:`~.exchange.KvExchange.pull`): its remote agent being added, then its read in
    flight. The row's ``RemotePrefill``."""

    def __init__(
        self,
        exchange: PullSite,
        remote: str,
        hold_id: str,
        addr: int,
        offset: int,
        entries: list[Entry],
        nbytes: int,
        connected: Future[None],
    ) -> None:
        self.exchange = exchange
        self.remote = remote
        self.hold_id = hold_id
        self.addr = addr  # of the slot, in the prefill engine
        self.offset = offset  # of the receive slot
        self.entries = entries
        self.nbytes = nbytes
        self.connected = connected
        self.handle: Any = None  # the read's, once started
        self.started = time.monotonic()
        self.elapsed = 0.0  # from the start until the read was seen done
        self.ended = False  # its handle and slot were released (or are cooling)

    @property
    def overdue(self) -> bool:
        return time.monotonic() - self.started > self.exchange.pull_timeout_s

    def begin_if_connected(self) -> None:
        """Start the read once the remote agent is known; raises :class:`KvTransferError`
        (counted failed) when it cannot be."""
        if self.handle is not None or not self.connected.done():
            return
        error = self.connected.exception()
        try:
            if error is not None:
                raise KvTransferError(f"the prefill engine's agent could not be added: {error}")
            self.handle = self.exchange.begin_read(self)
        except Exception as exc:
            self.end(aborted=False)
            self.exchange.forget(self.remote)
            self._failed(str(exc))

    def poll(self) -> dict[str, Tensor] | None:
        """The tensors once the read is done, None while it runs; raises
        :class:`KvTransferError` (counted failed) when it failed or took too long."""
        if self.ended:
            raise KvTransferError("kv_transfer: this pull already ended")
        exchange = self.exchange
        self.begin_if_connected()
        if self.handle is None:  # still connecting
            if self.overdue:
                self.end(aborted=False)
                self._failed(f"the prefill engine not reached in {exchange.pull_timeout_s:g} s")
            return None
        state = self._state()
        if state == "PROC":
            if not self.overdue:
                return None
            self.end(aborted=True)  # the peer may be alive: it stays known
            self._failed(f"no answer within {exchange.pull_timeout_s:g} s")
        if state != "DONE":
            self.end(aborted=False)
            exchange.forget(self.remote)
            self._failed(f"the read failed ({state})")
        self.elapsed = time.monotonic() - self.started
        try:
            tensors = exchange.tensors_at(self.offset, self.entries)
        except Exception as exc:  # a layout the slot's bytes cannot take
            self._failed(f"unreadable: {exc}")
        finally:
            self.end(aborted=False)
        if bytes(tensors.pop(TAG).tolist()) != bytes.fromhex(self.hold_id):
            self._failed("the slot holds another prefill (pulled twice?)")
        return tensors

    def arrived(self, ok: bool) -> None:
        """The row took the state (counted pulled) or refused it (counted failed)."""
        counts = self.exchange.counts
        if not ok:
            counts.failed += 1
            return
        counts.pulled += 1
        counts.pulled_bytes += self.nbytes
        counts.pulled_s += self.elapsed

    def cancel(self) -> None:
        """Stop waiting (an aborted request). A read still running is left to finish (its
        notification frees the prefill's slot), aborted after ``pull_timeout_s``."""
        if not self.ended and not self.settled():
            self.exchange.drain(self)

    def settled(self) -> bool:
        """True once the read stopped (or never started) and its slot was released (a pull
        cancelled while its agent was being added reads nothing: the prefill's lease frees
        its slot)."""
        if self.ended:
            return True
        if self.handle is None:  # no read started: nothing writes into the slot
            self.end(aborted=False)
            return True
        if self._state() == "PROC":
            if not self.overdue:
                return False
            self.end(aborted=True)
            return True
        self.end(aborted=False)
        return True

    def end(self, *, aborted: bool) -> None:
        """Release the handle (aborting a read in flight) and the slot: at once after a
        finished read (or none), after cooling after an aborted one (it may still write)."""
        if self.ended:
            return
        self.ended = True
        exchange = self.exchange
        exchange.read_ended(self.remote)
        if self.handle is not None:
            exchange.release_handle(self.handle)
        if aborted:
            exchange.cool(exchange.receive, self.offset)
        else:
            exchange.receive.give(self.offset)

    def _failed(self, why: str) -> NoReturn:
        self.exchange.counts.failed += 1
        raise KvTransferError(f"kv_transfer: pull of hold={self.hold_id} failed: {why}")

    def _state(self) -> str:
        try:
            return str(self.exchange.agent.check_xfer_state(self.handle))
        except Exception as exc:  # a disconnected peer raises here
            logger.debug("check_xfer_state: %s", exc)
            return "ERR"


DONE: Future[None] = Future()
DONE.set_result(None)


class Worker:
    """One daemon thread running submitted calls in order (``ThreadPoolExecutor``'s threads
    are joined at exit, and a connect to an unreachable peer blocks for minutes)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[
            tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ]
        self._calls = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, fn, args))
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the future's reader
                future.set_exception(exc)
