"""Hand-off: deliver a :class:`StageInput` to a replica of its stage and bring back the answer.

The sender keeps custody of the input until a replica answers (invariant 3): a hop that fails
before an answer — connection refused or reset, a 5xx, a replica that vanished, a timeout — is
replayed on another replica, within the retry budget and the request's deadline. A full replica
(429) is not a failure: the next one is tried, and when every replica is full the hop waits,
bounded by the deadline. The same goes for an empty pool (stages started in any order).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from omni_mesh.data_plane import codec, wire
from omni_mesh.data_plane.connectors import Connector
from omni_mesh.data_plane.messages import HopResult, StageError, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.hop_http import HopConnectionError, HopHttpClient
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
    """No replica of the stage could take the hop before the deadline (→ 503)."""

    def __init__(self, stage_id: int, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.stage_id = stage_id
        self.retry_after_s = retry_after_s


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
        """Hand ``si`` to a replica of its stage; the answer carries the downstream result."""
        stats = HopStats()
        t0 = time.monotonic()
        connector = self.connector_for(si.from_stage, si.stage_id)

        def body_for(replica: Replica, attempt: int) -> bytes:
            same_host = replica.host_id == self.router.host_id
            payload = connector.prepare(si.payload, same_host=same_host, reader=self.reader)
            return codec.encode(msgspec.structs.replace(si, payload=payload, attempt=attempt))

        try:
            answer = await self.call(
                si.stage_id,
                HOP_PATH,
                body_for,
                content_type=wire.MSGPACK,
                deadline_ms=si.deadline_ms,
                prefer_same_host=connector.prefers_same_host,
                stats=stats,
                first_attempt=si.attempt,
            )
            return _hop_result(si, answer)
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
    ) -> Answer:
        """POST to ``path`` on a replica of ``stage_id``. A replica failure (connection
        refused/reset, 502/503/504, a timeout before the deadline, an unreadable answer) is
        replayed on another replica within the retry budget; busy replicas (409/429) are
        skipped; an empty or all-busy pool is waited on. Raises :class:`HopUnavailable`."""
        stats = stats or HopStats()
        busy: set[str] = set()
        failures = 0
        backoff = 0.005
        while True:
            remaining_s = (deadline_ms - now_ms()) / 1000.0
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
                replica, path, body, content_type, deadline_ms, remaining_s, stats
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
    ) -> Answer | None:
        """One try; ``None`` when the replica failed (it is ejected)."""
        stats.attempts += 1
        stats.bytes_sent += len(body)
        stats.tried.append(replica.instance_id)
        stats.replica = replica.instance_id
        headers = {"Content-Type": content_type, **self.auth_header}
        self.router.begin(replica.instance_id)
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
            )
            if resp.status in _REPLICA_FAILED:
                text = bytes(resp.body[:300]).decode(errors="replace")
                self.router.eject(replica.instance_id, f"status {resp.status}: {text}")
                return None
            return Answer(resp.status, resp.body, resp.content_type, replica)
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
            self.router.end(replica.instance_id)


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
