"""A split stage's prompt state moved engine to engine over NIXL, for the transformers engines
(deploy ``prefill:``; the fabric's side: ``data_plane/kv_transfer.py``).

A prefill replica runs a request's prefill and :meth:`KvExchange.hold` copies what the decode
side needs to go on (the KV cache's layers, the row's own state: its first token, its
positions, its sampler's generator, the hidden states the next stage needs) into a slot of its
hold buffer, registered with its NIXL agent once at start. The answer's params (JSON) say where:
the agent's name and metadata (a few hundred bytes: a decode replica adds the agent from
them the first time it sees it), the slot's address and length, and each tensor's name, dtype,
shape and offset. A decode replica's :meth:`KvExchange.pull` starts one NIXL ``READ`` of the
slot into its own receive buffer; :meth:`KvPull.poll` gives the tensors once it is done. The
read carries a notification to the prefill engine, which then frees the slot; a slot nobody
pulls within ``lease_s`` is freed too (counted ``expired``). Only the params travel through
the sidecars.

A slot starts with a 16-byte tag, also in the params: a read that finds another tag (a slot
freed and reused: a second pull of the same params) fails rather than decoding someone else's
KV. An expired hold's slot is reused only after ``pull_timeout_s`` more (a read started before
the lease ran out may still be running), as is the receive slot of a read aborted in flight. A
pull that fails (the prefill engine is gone, the read errs or takes longer than
``pull_timeout_s``, the params are unusable or of another version, no room here, a state the
row refuses) raises :class:`KvTransferError` and is counted ``failed``: the engine then
prefills the request itself. A pull cancelled while its read runs lets the read finish (its
notification frees the prefill's slot). ``pulled_s`` is the time from a read's start until
the engine saw it done (it polls once per step).

Memory: the buffers are host memory. On a GPU the tensors are copied to the host to be held,
and back after the pull (NIXL can read GPU memory directly; that is a follow-up).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from omni_mesh.data_plane.kv_transfer import KvTransferError
from omni_mesh.engines.hf.kv_arena import ALIGN, SlotAllocator
from omni_mesh.engines.kv_counts import KvCounts
from omni_mesh.engines.nixl_agents import nixl_agent

logger = logging.getLogger(__name__)

TAG = "tag"  # the slot's first tensor: 16 bytes naming the hold
PULLED = b"pulled:"  # a read's notification to the prefill engine: PULLED + hold id
DTYPES = {
    name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "int64", "uint8")
}
#: The params' format (``"v"``): a decode engine refuses another (a rolling upgrade).
PARAMS_VERSION = 1
#: Remote agents a decode engine keeps (their connections) at most.
MAX_PEERS = 64
#: Longest params text a pull accepts (a layout per layer: ~100 bytes each).
MAX_PARAMS_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor in a slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the slot's start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * int(DTYPES[self.dtype].itemsize)


@dataclass
class _Hold:
    offset: int  # of its slot in the hold buffer
    expires: float  # time.monotonic()


class KvExchange:
    """One engine's NIXL agent, its hold and receive buffers, and the holds and pulls in
    flight (module docstring). Every call comes from the engine's thread."""

    def __init__(
        self,
        name: str,
        *,
        buffer_bytes: int,
        lease_s: float,
        pull_timeout_s: float,
        progress_delay_us: int,
    ) -> None:
        self.name = name
        self.lease_s = lease_s
        self.pull_timeout_s = pull_timeout_s
        self.counts = KvCounts()
        self.agent = nixl_agent(name, progress_delay_us)
        # One registration for both: the first half holds, the second receives.
        self._buffer = torch.empty(2 * buffer_bytes, dtype=torch.uint8)
        self._registered = self.agent.register_memory(self._buffer)
        self._base = int(self._buffer.data_ptr())
        self.holds = SlotAllocator(buffer_bytes)
        self.receive = SlotAllocator(buffer_bytes)
        self._receive_at = buffer_bytes
        self._metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._held: dict[str, _Hold] = {}
        self._peers: OrderedDict[str, bytes] = OrderedDict()  # remote agents added: metadata
        self._connecting: dict[str, tuple[Future[None], bytes]] = {}
        # One thread adds and removes remote agents, in order (vLLM's connector hands its
        # handshakes to a thread too): NIXL connects as it adds one, and blocks while the
        # peer is unreachable. A daemon: a connect that hangs never holds the process's exit.
        self._connector = _Worker("kv-connect")
        self._reading: Counter[str] = Counter()  # pulls in flight, by remote agent
        self._draining: list[KvPull] = []  # cancelled, their reads still running
        # Slots not reused yet: (when, allocator, offset). An expired hold's slot may still be
        # read by a pull that started before it expired, for up to pull_timeout_s (every pool
        # of a stage has the same engine_extras); an aborted read's slot may still be written.
        self._cooling: list[tuple[float, SlotAllocator, int]] = []

    # ---- the prefill side ------------------------------------------------------------------

    def hold(self, tensors: dict[str, Tensor]) -> str:
        """Copy ``tensors`` into a free slot and keep it for a pull; the params saying where.
        Raises :class:`KvTransferError` when the buffer has no room."""
        tag = uuid.uuid4()
        named = {TAG: torch.frombuffer(bytearray(tag.bytes), dtype=torch.uint8), **tensors}
        entries, total = _layout(named)
        offset = self.holds.take(total)
        if offset is None:
            raise KvTransferError(
                f"the KV hold buffer is full ({self.holds.used} of {self.holds.capacity} bytes "
                f"held; this prefill needs {total}: engine_extras.kv_buffer_mib)"
            )
        for entry in entries:
            start = offset + entry.offset
            flat = named[entry.name].detach().to("cpu").contiguous().reshape(-1)
            self._buffer[start : start + entry.nbytes].copy_(flat.view(torch.uint8))
        self._held[tag.hex] = _Hold(offset, time.monotonic() + self.lease_s)
        params = {
            "v": PARAMS_VERSION,
            "remote_engine_id": self.name,
            "agent": self._metadata,
            "hold": tag.hex,
            "addr": self._base + offset,
            "nbytes": total,
            "tensors": [[e.name, e.dtype, list(e.shape), e.offset] for e in entries],
        }
        return json.dumps(params, separators=(",", ":"))

    @property
    def held(self) -> int:
        """Holds not pulled nor expired yet."""
        return len(self._held)

    def tick(self) -> None:
        """Free the slots whose pull finished (the readers' notifications); cool those whose
        lease ran out; settle the cancelled pulls; free the slots that cooled down."""
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                if message.startswith(PULLED):
                    hold = self._held.pop(message[len(PULLED) :].decode(errors="replace"), None)
                    if hold is not None:
                        self.holds.give(hold.offset)
        now = time.monotonic()
        for hold_id in [h for h, hold in self._held.items() if hold.expires <= now]:
            self.cool(self.holds, self._held.pop(hold_id).offset)
            self.counts.expired += 1
            logger.info("KV of hold=%s not pulled within %.0f s: freed", hold_id, self.lease_s)
        self._settle_connects()
        self._draining = [pull for pull in self._draining if not pull.settled()]
        if self._cooling and self._cooling[0][0] <= now:
            ready = [c for c in self._cooling if c[0] <= now]
            self._cooling = [c for c in self._cooling if c[0] > now]
            for _, allocator, offset in ready:
                allocator.give(offset)

    def cool(self, allocator: SlotAllocator, offset: int) -> None:
        """Free a slot after ``pull_timeout_s`` (a read may still touch it until then)."""
        self._cooling.append((time.monotonic() + self.pull_timeout_s + 1.0, allocator, offset))
        self._cooling.sort(key=lambda c: c[0])

    # ---- the decode side -------------------------------------------------------------------

    def pull(self, params_text: str) -> KvPull:
        """Start reading the slot ``params_text`` names (a prefill answer's params). Raises
        :class:`KvTransferError` (counted failed) when it cannot start."""
        try:
            pull = self._start(params_text)
        except Exception as exc:
            self.counts.failed += 1
            if isinstance(exc, KvTransferError):
                raise
            raise KvTransferError(f"kv_transfer: {type(exc).__name__}: {exc}") from None
        pull.begin_if_connected()  # a known peer's read starts now (counts its own failure)
        return pull

    def _start(self, params_text: str) -> KvPull:
        remote, metadata, hold_id, addr, entries, nbytes = _parse(params_text)
        if nbytes > self.receive.capacity:
            raise KvTransferError(
                f"kv_transfer: {nbytes} bytes, more than this engine's receive buffer "
                f"({self.receive.capacity}: engine_extras.kv_buffer_mib)"
            )
        offset = self.receive.take(nbytes)
        if offset is None:
            raise KvTransferError("kv_transfer: the receive buffer is full")
        connected = self._connect(remote, metadata)
        self._reading[remote] += 1
        return KvPull(self, remote, hold_id, addr, offset, entries, nbytes, connected)

    def begin_read(self, pull: KvPull) -> Any:
        """Start ``pull``'s NIXL read (its remote agent is known); the handle."""
        here = self.agent.get_xfer_descs(
            [(self._base + self._receive_at + pull.offset, pull.nbytes, 0)], "DRAM"
        )
        there = self.agent.get_xfer_descs([(pull.addr, pull.nbytes, 0)], "DRAM")
        handle = self.agent.initialize_xfer(
            "READ", here, there, pull.remote, PULLED + pull.hold_id.encode()
        )
        try:
            state = str(self.agent.transfer(handle))
        except Exception as exc:  # a disconnected peer
            state = f"ERR ({exc})"
        if state.startswith("ERR"):
            self._release_handle(handle)
            raise KvTransferError(f"the read failed at once: {state}")
        return handle

    def _connect(self, remote: str, metadata: bytes) -> Future[None]:
        """The remote agent known to NIXL: a done future for a known peer, else its adding
        (NIXL connects there, which blocks while the peer is unreachable: on the connecting
        thread, never the engine's)."""
        if self._peers.get(remote) == metadata:
            self._peers.move_to_end(remote)
            return _DONE
        pending = self._connecting.get(remote)
        if pending is not None and pending[1] == metadata:
            return pending[0]
        self.forget(remote)  # its metadata changed: a restarted engine of the same name
        future = self._connector.submit(self._add, remote, metadata)
        self._connecting[remote] = (future, metadata)
        return future

    def _add(self, remote: str, metadata: bytes) -> None:
        """(On the connecting thread.) Add the remote agent; its name must be the params'."""
        named = self.agent.add_remote_agent(metadata)
        named = named.decode() if isinstance(named, bytes) else str(named)
        if named != remote:  # metadata of another agent than the params name
            self.agent.remove_remote_agent(named)
            raise KvTransferError(f"the metadata is agent {named!r}, not {remote!r}")

    def _settle_connects(self) -> None:
        """Record the agents added since; the longest unused ones without reads in flight are
        dropped past :data:`MAX_PEERS`."""
        for remote, (future, metadata) in list(self._connecting.items()):
            if future.done():
                del self._connecting[remote]
                if future.exception() is None:
                    self._peers[remote] = metadata
        for peer in [p for p in self._peers if not self._reading[p]]:
            if len(self._peers) <= MAX_PEERS:
                break
            self.forget(peer)

    def forget(self, remote: str) -> None:
        """Drop a remote agent (a read from it failed: a restarted or dead engine; unused)."""
        if self._peers.pop(remote, None) is not None:
            self._connector.submit(self._remove, remote)

    def _remove(self, remote: str) -> None:
        try:
            self.agent.remove_remote_agent(remote)
        except Exception:  # already gone from NIXL's view
            logger.debug("remove_remote_agent %s", remote, exc_info=True)

    def _release_handle(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            logger.debug("release_xfer_handle", exc_info=True)

    def tensors_at(self, offset: int, entries: list[Entry]) -> dict[str, Tensor]:
        """Copies of the tensors a finished read left at ``offset`` of the receive buffer."""
        start = self._receive_at + offset
        out = {}
        for e in entries:
            raw = self._buffer[start + e.offset : start + e.offset + e.nbytes]
            out[e.name] = raw.view(DTYPES[e.dtype]).reshape(e.shape).clone()
        return out

    def close(self) -> None:
        for pull in self._draining:
            pull.end(aborted=True)
        self._draining = []
        self._connector.stop()
        try:
            self.agent.deregister_memory(self._registered)
        except Exception:
            logger.debug("deregister_memory", exc_info=True)


class KvPull:
    """One pull (:meth:`KvExchange.pull`): its remote agent being added, then its read in
    flight. The row's ``RemotePrefill``."""

    def __init__(
        self,
        exchange: KvExchange,
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
            self.exchange._draining.append(self)

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
        exchange._reading[self.remote] -= 1
        if self.handle is not None:
            exchange._release_handle(self.handle)
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


_DONE: Future[None] = Future()
_DONE.set_result(None)


class _Worker:
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


def _layout(tensors: dict[str, Tensor]) -> tuple[list[Entry], int]:
    entries, offset = [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise KvTransferError(f"cannot hold {name}: dtype {dtype}")
        entry = Entry(name, dtype, tuple(int(n) for n in t.shape), offset)
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return entries, offset


def _parse(text: str) -> tuple[str, bytes, str, int, list[Entry], int]:
    """(remote agent, its metadata, hold id, address, entries, bytes) of a prefill answer's
    params; :class:`KvTransferError` naming what is wrong."""
    if len(text) > MAX_PARAMS_BYTES:
        raise KvTransferError(f"kv_transfer: longer than {MAX_PARAMS_BYTES} bytes")
    try:
        p = json.loads(text)
        if p.get("v") != PARAMS_VERSION:
            raise ValueError(f"params version {p.get('v')!r}, this engine reads {PARAMS_VERSION}")
        remote, hold_id = str(p["remote_engine_id"]), str(p["hold"])
        metadata = base64.b64decode(p["agent"], validate=True)
        addr, nbytes = int(p["addr"]), int(p["nbytes"])
        entries = [
            Entry(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in p["tensors"]
        ]
        if len(bytes.fromhex(hold_id)) != 16:
            raise ValueError("hold is not 16 bytes")
    except Exception as exc:  # any shape of bad JSON: not a prefill's params
        raise KvTransferError(
            f"kv_transfer: not a transformers prefill's params ({type(exc).__name__}: {exc})"
        ) from None
    if not remote or addr < 0 or nbytes <= 0 or not entries:
        raise KvTransferError("kv_transfer: not a transformers prefill's params")
    if (entries[0].name, entries[0].dtype, entries[0].shape) != (TAG, "uint8", (16,)):
        raise KvTransferError("kv_transfer: the slot does not start with its tag")
    for e in entries:
        if e.dtype not in DTYPES or any(n < 0 for n in e.shape):
            raise KvTransferError(f"kv_transfer: tensor {e.name!r}: bad dtype or shape")
        if e.offset < 0 or e.offset % ALIGN or e.offset + e.nbytes > nbytes:
            raise KvTransferError(f"kv_transfer: tensor {e.name!r} lies outside the slot")
    return remote, metadata, hold_id, addr, entries, nbytes
