"""Hand-off: deliver a :class:`StageInput` to a replica of its stage and bring back the answer.

The sender keeps custody of the input until a replica answers (invariant 3): a hop that fails
before an answer — connection refused or reset, a 5xx, a replica that vanished, a timeout — is
replayed on another replica, within the retry budget and the request's deadline. A full replica
(429) is not a failure: the next one is tried, and when every replica is full the hop waits,
bounded by the deadline. The same goes for an empty pool (stages started in any order).

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
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from omni_mesh.data_plane import codec, wire
from omni_mesh.data_plane.connectors import Connector
from omni_mesh.data_plane.constants import HOP_FRAMES, MSGPACK
from omni_mesh.data_plane.messages import HopResult, StageError, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.hop_http import FrameReader, HopConnectionError, HopHttpClient
from omni_mesh.sidecar.router import Replica, Router

logger = logging.getLogger(__name__)

HOP_PATH = "/v1/hop"
HOP_TOKEN_HEADER = "X-Omni-Hop-Token"
MAX_RESULT_BYTES = 1 << 30
DEADLINE_GRACE_S = 2.0
#: Statuses that say the replica (not the request) failed: replay elsewhere, eject it.
_REPLICA_FAILED = frozenset({502, 503, 504})
#: Statuses that say the replica is busy: try another, no failure counted.
_BUSY = frozenset({409, 429})


class HopUnavailable(Exception):
    """No replica of the stage could take the hop before the deadline (→ 503), or the
    deadline had passed before the hop was even tried (``code="deadline"`` → 504)."""

    def __init__(
        self,
        stage_id: int,
        message: str,
        retry_after_s: float = 1.0,
        code: Literal["unavailable", "deadline"] = "unavailable",
    ) -> None:
        super().__init__(message)
        self.stage_id = stage_id
        self.retry_after_s = retry_after_s
        self.code = code


@dataclass
class HopStats:
    """What one hop cost; fed to metrics by the caller."""

    attempts: int = 0
    retries: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    replica: str = ""
    waited_full: int = 0
    tried: list[str] = field(default_factory=list)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Answer:
    """A replica's answer to a replayed call (any status that is not a replica failure)."""

    status: int
    body: bytearray
    content_type: str
    replica: Replica
    frames: FrameReader | None = None  # a streamed answer; the replica stays "in flight"


BodyFor = Callable[[Replica, int], bytes]


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
    ) -> None:
        self.http = http
        self.router = router
        self.connector_for = connector_for
        self.reader = reader
        self.retries = retries
        self.auth_header = dict(auth_header or {})
        self.on_hop = on_hop

    # ---- the hop -------------------------------------------------------------------------

    async def send(self, si: StageInput) -> HopResult:
        """Hand ``si`` to a replica whose answer is one frame (nothing downstream streams)."""
        frames = [frame async for frame in self.stream(si)]
        if len(frames) != 1:
            raise RuntimeError(f"the answer to {si.request_id} streamed; use stream()")
        return frames[0]

    async def stream(self, si: StageInput) -> AsyncGenerator[HopResult, None]:
        """Hand ``si`` to a replica of its stage and yield the answer's frames: one frame for a
        whole answer, or a stream (every frame but the last has ``more=True``). Replays on
        replica failure, mid-stream included, yielding each (stage, chunk) once."""
        stats = HopStats()
        t0 = time.monotonic()
        connector = self.connector_for(si.from_stage, si.stage_id)
        seen: set[tuple[int, int]] = set()
        failures = 0

        def body_for(replica: Replica, attempt: int) -> bytes:
            same_host = replica.host_id == self.router.host_id
            payload = connector.prepare(si.payload, same_host=same_host, reader=self.reader)
            return codec.encode(msgspec.structs.replace(si, payload=payload, attempt=attempt))

        try:
            while True:
                answer = await self.call(
                    si.stage_id,
                    HOP_PATH,
                    body_for,
                    content_type=MSGPACK,
                    deadline_ms=si.deadline_ms,
                    prefer_same_host=connector.prefers_same_host,
                    stats=stats,
                    first_attempt=si.attempt + failures,
                    failures=failures,
                    stream_type=HOP_FRAMES,
                )
                if answer.frames is None:
                    yield _unseen(_hop_result(si, answer), seen)
                    return
                replica = answer.replica
                try:
                    async with answer.frames as frames:
                        async for raw in frames:
                            frame = _unseen(codec.decode(raw, HopResult), seen)
                            if not frame.more:
                                yield frame
                                return
                            if frame.outputs or frame.timings:  # not all replayed
                                yield frame
                    raise HopConnectionError("the stream ended before its last frame")
                except (HopConnectionError, wire.WireError, ValueError, TimeoutError) as exc:
                    # Broke off mid-stream: the replica failed; replay what is missing.
                    if now_ms() < si.deadline_ms or not isinstance(exc, TimeoutError):
                        self.router.eject(
                            replica.instance_id,
                            f"stream broke off: {type(exc).__name__}: {exc}",
                            connection_level=isinstance(exc, HopConnectionError),
                        )
                    failures = stats.retries + 1  # those spent inside call() count too
                    if now_ms() >= si.deadline_ms:
                        raise HopUnavailable(
                            si.stage_id,
                            f"the request's deadline passed while stage {si.stage_id} "
                            f"({replica.instance_id}) was streaming its answer",
                            code="deadline",
                        ) from exc
                    if failures > self.retries:
                        raise HopUnavailable(
                            si.stage_id,
                            f"stage {si.stage_id}: streamed answer from {replica.instance_id} "
                            f"broke off ({type(exc).__name__}: {exc}); retry budget "
                            f"({self.retries}) spent",
                        ) from exc
                    stats.retries += 1
                    logger.info(
                        "replaying streamed hop request_id=%s stage=%d after %s: %d chunk(s) "
                        "already delivered",
                        si.request_id,
                        si.stage_id,
                        replica.instance_id,
                        len(seen),
                    )
                finally:
                    self.router.end(replica.instance_id)
        finally:
            stats.seconds = time.monotonic() - t0
            if self.on_hop is not None:
                self.on_hop(si, stats)

    # ---- replayed calls ------------------------------------------------------------------

    async def call(
        self,
        stage_id: int,
        path: str,
        body_for: BodyFor,
        *,
        content_type: str,
        deadline_ms: int,
        prefer_same_host: bool = False,
        stats: HopStats | None = None,
        first_attempt: int = 0,
        failures: int = 0,
        stream_type: str | None = None,
    ) -> Answer:
        """POST to ``path`` on a replica of ``stage_id``. A replica failure (connection
        refused/reset, 502/503/504, a timeout before the deadline, an unreadable answer) is
        replayed on another replica within the retry budget; busy replicas (409/429) are
        skipped; an empty or all-busy pool is waited on. Raises :class:`HopUnavailable`.

        An answer of ``stream_type`` comes back unread (:attr:`Answer.frames`), its replica
        still counted in flight: the caller reads the frames and calls ``router.end``.
        ``failures`` is how much of the retry budget earlier calls of this hop spent."""
        stats = stats or HopStats()
        busy: set[str] = set()
        first_attempt -= failures
        backoff = 0.005
        while True:
            remaining_s = (deadline_ms - now_ms()) / 1000.0
            if remaining_s <= 0 and not (stats.tried or stats.waited_full):
                raise HopUnavailable(
                    stage_id,
                    f"the request's deadline passed before its hand-off to stage {stage_id}",
                    code="deadline",
                )
            if remaining_s <= 0:
                raise HopUnavailable(
                    stage_id,
                    f"no replica of stage {stage_id} answered before the request's deadline "
                    f"(tried {len(stats.tried)}: {', '.join(stats.tried) or 'pool empty'})",
                )
            replica = self.router.pick(stage_id, exclude=busy, prefer_same_host=prefer_same_host)
            if replica is None:
                # Empty pool, or every replica busy: wait (bounded by the deadline), retry.
                busy.clear()
                stats.waited_full += 1
                await asyncio.sleep(min(backoff, remaining_s))
                backoff = min(backoff * 2, 0.25)
                continue
            body = body_for(replica, first_attempt + failures)
            answer = await self._attempt(
                replica, path, body, content_type, deadline_ms, remaining_s, stats, stream_type
            )
            if answer is not None and answer.status not in _BUSY:
                return answer
            if answer is not None:  # busy: not a failure
                busy.add(replica.instance_id)
                continue
            failures += 1
            if failures > self.retries:
                raise HopUnavailable(
                    stage_id,
                    f"stage {stage_id}: failed on {failures} replica(s), retry budget "
                    f"({self.retries}) spent (last: {replica.instance_id})",
                )
            stats.retries += 1

    async def _attempt(
        self,
        replica: Replica,
        path: str,
        body: bytes,
        content_type: str,
        deadline_ms: int,
        remaining_s: float,
        stats: HopStats,
        stream_type: str | None = None,
    ) -> Answer | None:
        """One try; ``None`` when the replica failed (it is ejected)."""
        stats.attempts += 1
        stats.bytes_sent += len(body)
        stats.tried.append(replica.instance_id)
        stats.replica = replica.instance_id
        headers = {"Content-Type": content_type, **self.auth_header}
        self.router.begin(replica.instance_id)
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
            if resp.status in _REPLICA_FAILED:
                text = bytes(resp.body[:300]).decode(errors="replace")
                self.router.eject(replica.instance_id, f"status {resp.status}: {text}")
                return None
            streaming = resp.frames is not None
            return Answer(resp.status, resp.body, resp.content_type, replica, resp.frames)
        except (HopConnectionError, wire.WireError) as exc:
            self.router.eject(
                replica.instance_id,
                f"{type(exc).__name__}: {exc}",
                connection_level=isinstance(exc, HopConnectionError),
            )
            return None
        except TimeoutError:
            if now_ms() < deadline_ms:
                self.router.eject(replica.instance_id, "timed out")
            return None
        finally:
            if not streaming:
                self.router.end(replica.instance_id)


def _unseen(frame: HopResult, seen: set[tuple[int, int]]) -> HopResult:
    """``frame`` without the (stage, chunk) outputs already passed on (a replayed stream
    regenerates them); records the rest as seen."""
    if not frame.outputs:
        return frame
    fresh = {}
    for stage_id, payload in frame.outputs.items():
        key = (stage_id, frame.chunks.get(stage_id, 0))
        if key not in seen:
            seen.add(key)
            fresh[stage_id] = payload
    if len(fresh) == len(frame.outputs):
        return frame
    chunks = {k: v for k, v in frame.chunks.items() if k in fresh}
    return msgspec.structs.replace(frame, outputs=fresh, chunks=chunks)


def _hop_result(si: StageInput, answer: Answer) -> HopResult:
    """Interpret a replica's answer to a hop (any non-200 is a request-level error)."""
    if answer.status == 200:
        try:
            return codec.decode(answer.body, HopResult)
        except ValueError as exc:
            message = f"unreadable hop answer from {answer.replica.instance_id}: {exc}"
            code = "engine_error"
    else:
        message = _error_message(answer.body)
        code = "bad_input" if 400 <= answer.status < 500 else "engine_error"
    return HopResult(
        request_id=si.request_id,
        error=StageError(code=code, message=message, stage_id=si.stage_id),  # type: ignore[arg-type]
    )


def _error_message(body: bytearray) -> str:
    with contextlib.suppress(msgspec.DecodeError, KeyError, TypeError):
        message = msgspec.json.decode(body)["error"]["message"]
        if isinstance(message, str):
            return message
    return bytes(body[:500]).decode(errors="replace")
