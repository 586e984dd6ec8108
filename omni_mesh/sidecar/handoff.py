"""Hand-off: deliver a :class:`StageInput` to a replica of its stage and bring back the answer.

The sender keeps custody of the input until a replica answers (invariant 3): a hop that fails
before an answer — connection refused or reset, a 5xx, a replica that vanished, a timeout — is
replayed on another replica, within the retry budget and the request's deadline. A full replica
(429) is not a failure: the next one is tried, and when every replica is full the hop waits,
bounded by the deadline. The same goes for an empty pool (stages started in any order).
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from omni_mesh.data_plane import codec, wire
from omni_mesh.data_plane.connectors import Connector
from omni_mesh.data_plane.messages import HopResult, Payload, StageError, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.router import Replica, Router

logger = logging.getLogger(__name__)

HOP_PATH = "/v1/hop"
MAX_RESULT_BYTES = 1 << 30
DEADLINE_GRACE_S = 2.0
_RETRYABLE_STATUS = {500, 502, 503, 504}


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


class HopClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        router: Router,
        connector_for: Callable[[int, int], Connector],
        reader: ShmReader,
        *,
        retries: int,
        auth_header: dict[str, str] | None = None,
        on_hop: Callable[[StageInput, HopStats], None] | None = None,
    ) -> None:
        self.session = session
        self.router = router
        self.connector_for = connector_for
        self.reader = reader
        self.retries = retries
        self.headers = {"Content-Type": wire.MSGPACK, **(auth_header or {})}
        self.on_hop = on_hop

    async def send(self, si: StageInput) -> HopResult:
        stats = HopStats()
        t0 = time.monotonic()
        try:
            return await self._send(si, stats)
        finally:
            stats.seconds = time.monotonic() - t0
            if self.on_hop is not None:
                self.on_hop(si, stats)

    async def _send(self, si: StageInput, stats: HopStats) -> HopResult:
        connector = self.connector_for(si.from_stage, si.stage_id)
        prefer_local = connector.prefers_same_host
        full: set[str] = set()
        failures = 0
        backoff = 0.005
        while True:
            remaining_s = (si.deadline_ms - now_ms()) / 1000.0
            if remaining_s <= 0:
                raise HopUnavailable(
                    si.stage_id,
                    f"no replica of stage {si.stage_id} answered before the request's deadline "
                    f"(tried {len(stats.tried)}: {', '.join(stats.tried) or 'pool empty'})",
                )
            replica = self.router.pick(si.stage_id, exclude=full, prefer_same_host=prefer_local)
            if replica is None:
                # Empty pool, or every replica full: wait (bounded by the deadline), then retry.
                full.clear()
                stats.waited_full += 1
                await asyncio.sleep(min(backoff, remaining_s))
                backoff = min(backoff * 2, 0.25)
                continue
            result, status = await self._attempt(si, replica, connector, stats, remaining_s)
            if result is not None:
                return result
            if status == 429 or status == 409:
                full.add(replica.instance_id)
                continue
            failures += 1
            if failures > self.retries:
                raise HopUnavailable(
                    si.stage_id,
                    f"stage {si.stage_id}: hop failed on {failures} replica(s), retry budget "
                    f"({self.retries}) spent (last: {replica.instance_id}, status {status})",
                )
            stats.retries += 1
            si = _with_attempt(si, si.attempt + 1)

    async def _attempt(
        self,
        si: StageInput,
        replica: Replica,
        connector: Connector,
        stats: HopStats,
        remaining_s: float,
    ) -> tuple[HopResult | None, int]:
        """One try. Returns (result, 200), or (None, status) for a retryable outcome
        (status 0: connection-level failure)."""
        same_host = replica.host_id == self.router.host_id
        payload = connector.prepare(si.payload, same_host=same_host, reader=self.reader)
        body = codec.encode(_with_payload(si, payload))
        stats.attempts += 1
        stats.bytes_sent += len(body)
        stats.tried.append(replica.instance_id)
        stats.replica = replica.instance_id
        self.router.begin(replica.instance_id)
        try:
            # Downstream stages enforce the same deadline and answer when it passes; the grace
            # lets that answer travel back instead of timing out a healthy replica here.
            timeout = aiohttp.ClientTimeout(total=remaining_s + DEADLINE_GRACE_S)
            async with self.session.post(
                replica.address + HOP_PATH,
                data=io.BytesIO(body),
                headers=self.headers,
                timeout=timeout,
            ) as resp:
                if resp.status == 200:
                    data = await wire.read_response(resp, max_bytes=MAX_RESULT_BYTES)
                    return codec.decode(data, HopResult), 200
                if resp.status in (409, 429):
                    return None, resp.status
                text = (await resp.text())[:500]
                if resp.status in _RETRYABLE_STATUS:
                    self.router.eject(replica.instance_id, f"status {resp.status}: {text}")
                    return None, resp.status
                # A 4xx other than 409/429: the input is bad; replaying would not help.
                return HopResult(
                    request_id=si.request_id,
                    error=StageError(code="bad_input", message=text, stage_id=si.stage_id),
                ), resp.status
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            self.router.eject(replica.instance_id, f"{type(exc).__name__}: {exc}")
            return None, 0
        except TimeoutError:
            if now_ms() < si.deadline_ms:
                self.router.eject(replica.instance_id, "timed out")
            return None, 0
        finally:
            self.router.end(replica.instance_id)


def _with_payload(si: StageInput, payload: Payload) -> StageInput:
    return msgspec.structs.replace(si, payload=payload)


def _with_attempt(si: StageInput, attempt: int) -> StageInput:
    return msgspec.structs.replace(si, attempt=attempt)
