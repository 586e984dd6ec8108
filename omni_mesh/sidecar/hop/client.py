"""Hand-off: deliver a :class:`StageInput` to a replica of its stage and bring back the answer.

The sender keeps custody of the input until a replica answers (invariant 3): a hop that fails
before an answer — connection refused or reset, a 5xx, a replica that vanished, a timeout — is
replayed on another replica, within the retry budget and the request's deadline. A replica
whose admission queue sheds the hop (503 of type ``shed``, see ``sidecar/admission/admit.py``) or
that is busy with the same work (409) is not a failure: the next one is tried (P2C already
prefers the least loaded, queued hops included). When every replica sheds, the hop fails at
once with the largest Retry-After they gave — no sleep-and-retry loop. An empty pool (stages
started in any order) is waited on through the discovery cache's change event, bounded by the
deadline.

A receiver that streams (``async_chunk``) answers with frames; the sender keeps custody until
the last frame. A stream that breaks off is replayed on another replica, which regenerates the
same chunks (engines are deterministic for a seed): the chunks already passed on are dropped,
so the caller sees every (stage, chunk) exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from omni_mesh.data_plane import codec, wire
from omni_mesh.data_plane.connectors import Connector
from omni_mesh.data_plane.constants import HOP_FRAMES, MSGPACK
from omni_mesh.data_plane.kv_transfer import PREFILL_REQUEST
from omni_mesh.data_plane.messages import HopResult, StageError, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.hop.answers import error_message, shed_retry_after_of, unseen
from omni_mesh.sidecar.hop.budget import HopBudget, HopStats, HopUnavailable, now_ms
from omni_mesh.sidecar.hop.http import FrameReader, HopConnectionError, HopHttpClient
from omni_mesh.sidecar.hop.kv_handoff import KvHandoff
from omni_mesh.sidecar.hop.prefill_tokens import prompt_tokens
from omni_mesh.sidecar.hop.router import Replica, Router

logger = logging.getLogger(__name__)

HOP_PATH = "/v1/hop"
HOP_TOKEN_HEADER = "X-Omni-Hop-Token"
MAX_RESULT_BYTES = 1 << 30
DEADLINE_GRACE_S = 2.0
#: Statuses that say the replica (not the request) failed: replay elsewhere, eject it.
_REPLICA_FAILED = frozenset({502, 503, 504})
#: Statuses that say the replica is busy: try another, no failure counted.
_BUSY = frozenset({409, 429})
#: A hop waiting for an empty pool tells ``on_empty_pool`` again at least this often.
EMPTY_POOL_NOTICE_S = 1.0


@dataclass
class Answer:
    """A replica's answer to a replayed call (any status that is not a replica failure)."""

    status: int
    body: bytearray
    content_type: str
    replica: Replica
    frames: FrameReader | None = None  # a streamed answer; the replica stays "in flight"


BodyFor = Callable[[Replica, int], bytes]
#: ``body_for(replica, attempt, kv_transfer)`` of a hop whose KV hand-off the caller sets.
_KvBodyFor = Callable[[Replica, int, str], bytes]


class PoolChanges(Protocol):
    """The discovery cache's change event: returns when a stage's pool may have changed, or
    after ``timeout_s``."""

    async def wait_changed(self, timeout_s: float) -> None: ...


class HopClient:
    """Calls a replica of a stage, replaying on another one until an answer or the deadline."""

    def __init__(
        self,
        http: HopHttpClient,
        router: Router,
        connector_for: Callable[[int, int], Connector],
        reader: ShmReader,
        *,
        retries: int,
        auth_header: dict[str, str] | None = None,
        on_hop: Callable[[StageInput, HopStats], None] | None = None,
        pool_changes: PoolChanges | None = None,
        on_empty_pool: Callable[[int, int], None] | None = None,
    ) -> None:
        """``on_empty_pool(stage_id, hops_waiting)``: called at least every
        ``EMPTY_POOL_NOTICE_S`` while hops wait for a stage whose pool is empty (the pod
        wakes a stage scaled to zero; it rate-limits)."""
        self.http = http
        self.router = router
        self.connector_for = connector_for
        self.reader = reader
        self.retries = retries
        self.auth_header = dict(auth_header or {})
        self.on_hop = on_hop
        self.pool_changes = pool_changes
        self.on_empty_pool = on_empty_pool
        self._empty_waiters: dict[int, dict[int, float]] = {}  # stage → id(budget) → last look

    # ---- the hop -------------------------------------------------------------------------

    async def stream(self, si: StageInput) -> AsyncGenerator[HopResult, None]:
        """Hand ``si`` to a replica of its stage and yield the answer's frames: one frame for a
        whole answer, or a stream (every frame but the last has ``more=True``). Replays on
        replica failure, mid-stream included, yielding each (stage, chunk) once."""
        budget = HopBudget(si.stage_id, si.deadline_ms, self.retries, si.attempt)
        t0 = time.monotonic()
        connector = self.connector_for(si.from_stage, si.stage_id)
        seen: set[tuple[int, int]] = set()
        kv = KvHandoff()  # a split stage's: where the prompt's KV waits

        def body_for(replica: Replica, attempt: int, kv_transfer: str = "") -> bytes:
            same_host = replica.host_id == self.router.host_id
            payload = connector.prepare(si.payload, same_host=same_host, reader=self.reader)
            kv_transfer = kv_transfer or kv.params_for(attempt, budget.stats)
            new = msgspec.structs.replace(
                si, payload=payload, attempt=attempt, kv_transfer=kv_transfer
            )
            return codec.encode(new)

        try:
            while True:
                # 0) A split stage: the prompt is prefilled on a prefill replica first (again
                #    on a replay: the KV went to the replica that failed).
                if self.router.is_split(si.stage_id):
                    kv.prefilled(await self._prefilled(si, budget, body_for), budget.attempt)
                # 1) A replica answers (replayed on replica failures inside call()).
                answer = await self.call(
                    si.stage_id,
                    HOP_PATH,
                    body_for,
                    content_type=MSGPACK,
                    budget=budget,
                    prefer_same_host=connector.prefers_same_host,
                    stream_type=HOP_FRAMES,
                    affinity=si.affinity,
                )
                # 2) A whole answer: one frame, done.
                if answer.frames is None:
                    yield unseen(_hop_result(si, answer), seen)
                    return
                # 3) A streamed answer: pass on its frames until the last one …
                try:
                    async with contextlib.aclosing(_stream_frames(answer.frames, seen)) as frames:
                        async for frame in frames:
                            yield frame
                    return
                # 4) … or, when it breaks off, fail the replica and replay what is missing.
                except (HopConnectionError, wire.WireError, ValueError, TimeoutError) as exc:
                    self._stream_broke(budget, si, answer.replica, exc, delivered=len(seen))
                finally:
                    self.router.end(answer.replica.instance_id)
        finally:
            budget.stats.seconds = time.monotonic() - t0
            if self.on_hop is not None:
                self.on_hop(si, budget.stats)

    async def _prefilled(self, si: StageInput, budget: HopBudget, body_for: _KvBodyFor) -> str:
        """A split stage's prefill (``data_plane/kv_transfer.py``): a prefill replica computes
        the prompt's KV and says where it waits; those params go to the decode replica. When
        no prefill replica can (none, all failed or shed, a bad answer), "" : the decode
        replica prefills for itself. Each outcome is counted in ``budget.stats``.

        The prefill has a budget of its own (its failures spend none of the decode's
        retries) and at most half the time left before the deadline, so that a local prefill
        still has time when the prefill pool does not answer. The prefill replica is picked by
        the prompt tokens queued on it (``hop/prefill_tokens.py``)."""
        stats = budget.stats
        if self.router.candidates(si.stage_id, set(), prefill=True):
            half_ms = now_ms() + max(0, si.deadline_ms - now_ms()) // 2
            own = HopBudget(si.stage_id, min(si.deadline_ms, half_ms), self.retries)
            try:
                answer = await self.call(
                    si.stage_id,
                    HOP_PATH,
                    lambda replica, attempt: body_for(replica, attempt, PREFILL_REQUEST),
                    content_type=MSGPACK,
                    budget=own,
                    prefill=True,
                    prefill_tokens=prompt_tokens(si.payload),
                )
            except HopUnavailable as exc:
                if now_ms() >= si.deadline_ms:
                    raise
                why = str(exc)
            else:
                result = _hop_result(si, answer)
                if result.kv_transfer and result.error is None:
                    stats.kv_handoffs.append("remote")
                    return result.kv_transfer
                why = result.error.message if result.error else "an answer without KV params"
            finally:
                stats.add_tries(own.stats)
            logger.warning(
                "request_id=%s stage=%d: prefill replica unavailable, the decode replica "
                "prefills: %s",
                si.request_id,
                si.stage_id,
                why,
            )
        stats.kv_handoffs.append("local")
        return ""

    def _stream_broke(
        self,
        budget: HopBudget,
        si: StageInput,
        replica: Replica,
        exc: Exception,
        *,
        delivered: int,
    ) -> None:
        """A streamed answer broke off: the replica failed (a stream cut by the request's
        deadline is the deadline's doing: 504, no replay)."""
        why = f"{type(exc).__name__}: {exc}"
        self._replica_failed(replica, f"stream broke off: {why}", budget, exc)
        if now_ms() >= si.deadline_ms:
            raise HopUnavailable(
                si.stage_id,
                f"the request's deadline passed while stage {si.stage_id} "
                f"({replica.instance_id}) was streaming its answer",
                code="deadline",
            ) from exc
        try:
            budget.spend(
                f"stage {si.stage_id}: streamed answer from {replica.instance_id} broke off ({why})"
            )
        except HopUnavailable as spent:
            raise spent from exc
        logger.info(
            "replaying streamed hop request_id=%s stage=%d after %s: %d chunk(s) already delivered",
            si.request_id,
            si.stage_id,
            replica.instance_id,
            delivered,
        )

    # ---- replayed calls ------------------------------------------------------------------

    async def call(
        self,
        stage_id: int,
        path: str,
        body_for: BodyFor,
        *,
        content_type: str,
        budget: HopBudget | None = None,
        deadline_ms: int = 0,
        prefer_same_host: bool = False,
        stream_type: str | None = None,
        prefill: bool = False,
        prefill_tokens: int = 0,
        affinity: str = "",
    ) -> Answer:
        """POST to ``path`` on a replica of ``stage_id``. A replica failure (connection
        refused/reset, 502/503/504, a timeout before the deadline, an unreadable answer) is
        replayed on another replica within the retry budget; replicas that shed it or are busy
        (409/429) are skipped; when every replica shed it, it fails at once; an empty pool is
        waited on (all-busy: a short back-off). Raises :class:`HopUnavailable`.

        ``budget`` is the hop's (a fresh one for ``deadline_ms`` when not given). An answer
        of ``stream_type`` comes back unread (:attr:`Answer.frames`), its replica still
        counted in flight: the caller reads the frames and calls ``router.end``. ``prefill``:
        to a split stage's prefill pool, never waited for (see :meth:`_prefilled`), its
        ``prefill_tokens`` prompt tokens counted on each replica tried until it answers.
        ``affinity``: a session's key (``StageInput.affinity``), its replica first."""
        budget = budget or HopBudget(stage_id, deadline_ms, self.retries)
        busy: set[str] = set()
        sheds: dict[str, float] = {}  # replica → the Retry-After it gave
        wait = _FullWait()
        while True:
            remaining_s = budget.remaining_s()
            skip = busy | sheds.keys()
            replica = self.router.pick(
                stage_id,
                exclude=skip,
                prefer_same_host=prefer_same_host,
                prefill=prefill,
                affinity=affinity,
            )
            if replica is not None and affinity and not prefill:
                home = self.router.home(stage_id, affinity, prefer_same_host=prefer_same_host)
                budget.stats.affinity.append("home" if home == replica.instance_id else "moved")
            if replica is None:
                if sheds:
                    raise _every_replica_shed(stage_id, sheds)
                if prefill:  # no prefill replica left to try: the decode replica prefills
                    raise HopUnavailable(stage_id, f"stage {stage_id}: no prefill replica left")
                await self._wait_for_a_replica(stage_id, budget, wait, remaining_s, busy)
                busy.clear()
                continue
            body = body_for(replica, budget.attempt)
            answer = await self._attempt(
                replica, path, body, content_type, budget, remaining_s, stream_type, prefill_tokens
            )
            if answer is None:  # the replica failed (ejected): replay on another
                budget.spend(
                    f"stage {stage_id}: failed on {budget.failures + 1} replica(s) "
                    f"(last: {replica.instance_id})"
                )
            elif (retry_after_s := shed_retry_after_of(answer.status, answer.body)) is not None:
                budget.stats.shed += 1  # its queue is full: not a failure
                sheds[replica.instance_id] = retry_after_s
            elif answer.status in _BUSY:  # busy: not a failure
                busy.add(replica.instance_id)
            else:
                return answer

    async def _wait_for_a_replica(
        self,
        stage_id: int,
        budget: HopBudget,
        wait: _FullWait,
        remaining_s: float,
        busy: set[str],
    ) -> None:
        """No replica to try: an empty pool is waited on (:meth:`_wait_for_pool`); replicas
        that are busy with this very work (409) or ejected for a while are looked at again
        after a short back-off, bounded by the deadline."""
        budget.stats.waited_full += 1
        pool = [r for r in self.router.pools.replicas(stage_id) if r.kv_role != "prefill"]
        if not busy and not pool:  # (a split stage's prefill pool serves no hop of its own)
            if self.on_empty_pool is not None:  # a stage at zero: wake it, look again soon
                self.on_empty_pool(stage_id, self._waiting_for_empty(stage_id, budget))
                remaining_s = min(remaining_s, EMPTY_POOL_NOTICE_S)
            await self._wait_for_pool(remaining_s, wait)
            return
        await asyncio.sleep(min(wait.next_s(), remaining_s))

    def _waiting_for_empty(self, stage_id: int, budget: HopBudget) -> int:
        """How many hops wait for the empty pool of ``stage_id``: those that looked at it
        within ``2 * EMPTY_POOL_NOTICE_S``, this one included."""
        now = time.monotonic()
        seen = self._empty_waiters.setdefault(stage_id, {})
        seen[id(budget)] = now
        for key in [k for k, t in seen.items() if now - t > 2 * EMPTY_POOL_NOTICE_S]:
            del seen[key]
        return len(seen)

    async def _wait_for_pool(self, remaining_s: float, wait: _FullWait) -> None:
        """The stage's pool is empty (not started yet, or scaled to zero): wait for the
        discovery cache to change, bounded by the deadline (a back-off without one)."""
        if self.pool_changes is None:
            await asyncio.sleep(min(wait.next_s(), remaining_s))
            return
        await self.pool_changes.wait_changed(remaining_s)

    async def _attempt(
        self,
        replica: Replica,
        path: str,
        body: bytes,
        content_type: str,
        budget: HopBudget,
        remaining_s: float,
        stream_type: str | None = None,
        prefill_tokens: int = 0,
    ) -> Answer | None:
        """One try; ``None`` when the replica failed (see :meth:`_replica_failed`). The
        router counts the replica's request (and ``prefill_tokens``) until the answer."""
        stats = budget.stats
        stats.attempts += 1
        stats.bytes_sent += len(body)
        stats.tried.append(replica.instance_id)
        stats.replica = replica.instance_id
        headers = {"Content-Type": content_type, **self.auth_header}
        self.router.begin(replica.instance_id, prefill_tokens=prefill_tokens)
        streaming = False
        try:
            # Downstream stages enforce the same deadline and answer when it passes; the grace
            # lets that answer travel back instead of timing out a healthy replica here.
            resp = await self.http.post(
                replica.address,
                path,
                body,
                headers,
                timeout_s=remaining_s + DEADLINE_GRACE_S,
                max_bytes=MAX_RESULT_BYTES,
                stream_type=stream_type,
            )
            failed = resp.status in _REPLICA_FAILED
            if failed and shed_retry_after_of(resp.status, resp.body) is None:
                text = bytes(resp.body[:300]).decode(errors="replace")
                self._replica_failed(replica, f"status {resp.status}: {text}", budget)
                return None
            streaming = resp.frames is not None
            return Answer(resp.status, resp.body, resp.content_type, replica, resp.frames)
        except (HopConnectionError, wire.WireError, TimeoutError) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            self._replica_failed(replica, why, budget, exc)
            return None
        finally:
            if not streaming:
                self.router.end(replica.instance_id, prefill_tokens=prefill_tokens)

    def _replica_failed(
        self, replica: Replica, why: str, budget: HopBudget, exc: BaseException | None = None
    ) -> None:
        """The one place a replica is judged failed: it is ejected from the router (a
        connection-level failure lets the router report it as suspect), except after a
        timeout past the request's deadline, which is the request's doing, not the replica's."""
        if isinstance(exc, TimeoutError) and now_ms() >= budget.deadline_ms:
            return
        self.router.eject(
            replica.instance_id, why, connection_level=isinstance(exc, HopConnectionError)
        )


class _FullWait:
    """Back-off between looks at a pool that is empty or full: 5 ms, doubling, at most 250 ms."""

    def __init__(self) -> None:
        self._next_s = 0.005

    def next_s(self) -> float:
        wait_s, self._next_s = self._next_s, min(self._next_s * 2, 0.25)
        return wait_s


async def _stream_frames(
    reader: FrameReader, seen: set[tuple[int, int]]
) -> AsyncGenerator[HopResult, None]:
    """The frames of a streamed answer not passed on before, up to its last one; a stream that
    ends without a last frame raises :class:`HopConnectionError`."""
    async with reader as frames:
        async for raw in frames:
            frame = unseen(codec.decode(raw, HopResult), seen)
            if not frame.more:
                yield frame
                return
            if frame.outputs or frame.timings or frame.joins:  # not all replayed
                yield frame
    raise HopConnectionError("the stream ended before its last frame")


def _hop_result(si: StageInput, answer: Answer) -> HopResult:
    """Interpret a replica's answer to a hop (any non-200 is a request-level error)."""
    if answer.status == 200:
        try:
            return codec.decode(answer.body, HopResult)
        except ValueError as exc:
            message = f"unreadable hop answer from {answer.replica.instance_id}: {exc}"
            code = "engine_error"
    else:
        message = error_message(answer.body)
        code = "bad_input" if 400 <= answer.status < 500 else "engine_error"
    return HopResult(
        request_id=si.request_id,
        error=StageError(code=code, message=message, stage_id=si.stage_id),  # type: ignore[arg-type]
    )


def _every_replica_shed(stage_id: int, sheds: dict[str, float]) -> HopUnavailable:
    """The message ends with the largest Retry-After the replicas gave: it travels back
    through the stages before this one (a ``StageError``) to the client's ``Retry-After``."""
    retry_after_s = max(sheds.values())
    return HopUnavailable(
        stage_id,
        f"shed: every replica of stage {stage_id} shed the request "
        f"({', '.join(sorted(sheds))}: queues full or its deadline out of reach); "
        f"retry after {retry_after_s:.3f} s",
        retry_after_s=retry_after_s,
        code="shed",
    )
