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
import time
import uuid
from collections import Counter, OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from omni_mesh.data_plane.kv_transfer import KvTransferError
from omni_mesh.engines.kv.arena import SlotAllocator
from omni_mesh.engines.kv.counts import KvCounts
from omni_mesh.engines.kv.nixl_agents import nixl_agent
from omni_mesh.engines.kv.params import DTYPES, PARAMS_VERSION, PULLED, TAG, Entry, layout, parse
from omni_mesh.engines.kv.pull import DONE, KvPull, Worker

logger = logging.getLogger(__name__)

#: Remote agents a decode engine keeps (their connections) at most.
MAX_PEERS = 64


@dataclass
class _Hold:
    offset: int  # of its slot in the hold buffer
    expires: float  # time.monotonic()


class KvExchange:
    """One engine's NIXL agent, its hold and receive buffers, and the holds and pulls in
    flight (module docstring). Every call comes from the engine's thread; the agent itself is
    also called by the connecting thread, which adds and removes remote agents (as vLLM's
    connector adds them on a handshake thread while its worker transfers)."""

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
        self._connector = Worker("kv-connect")
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
        entries, total = layout(named)
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
        remote, metadata, hold_id, addr, entries, nbytes = parse(params_text)
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
            self.release_handle(handle)
            raise KvTransferError(f"the read failed at once: {state}")
        return handle

    def _connect(self, remote: str, metadata: bytes) -> Future[None]:
        """The remote agent known to NIXL: a done future for a known peer, else its adding
        (NIXL connects there, which blocks while the peer is unreachable: on the connecting
        thread, never the engine's)."""
        if self._peers.get(remote) == metadata:
            self._peers.move_to_end(remote)
            return DONE
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

    def drain(self, pull: KvPull) -> None:
        """Keep a cancelled pull until its read stopped (settled at each :meth:`tick`)."""
        self._draining.append(pull)

    def read_ended(self, remote: str) -> None:
        self._reading[remote] -= 1

    def release_handle(self, handle: Any) -> None:
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
