"""Store operations on Redis: the control plane's only state. Every write is one Lua script.

The store knows keys and scripts, not HTTP: it takes validated schema objects, returns plain
results, and lets ``redis.exceptions.ConnectionError``/``TimeoutError`` through (the API maps
them to 503).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.control_plane.schema import (
    REASON_UNREACHABLE,
    InstanceInfo,
    InstanceState,
    LoadReport,
    PipelineSnapshot,
    PipelineStatus,
    PoolSnapshot,
    RegisterRequest,
)
from omni_mesh.control_plane.store import scripts
from omni_mesh.control_plane.store.keys import RECORD_SCHEMA_VERSION, KeySchema
from omni_mesh.control_plane.store.scale import ScaleStore
from omni_mesh.control_plane.store.sessions import SessionStore

#: A heartbeat arriving sooner than this after a probe isolated its instance (``unreachable``)
#: does not readmit it: it may have been sent just before the process died.
UNREACHABLE_READMIT_GRACE_MS = 250

logger = logging.getLogger(__name__)


class StateAction(StrEnum):
    """Operator actions on an instance."""

    ISOLATE = "isolate"
    READMIT = "readmit"
    DRAIN = "drain"
    PROMOTE = "promote"  # a warm standby joins its pool (the autoscaler's, or an operator's)


class SettingsConflict(Exception):
    """A registration whose pipeline-wide setting disagrees with the live pods'."""

    def __init__(self, setting: str, theirs: str, ours: str) -> None:
        super().__init__(f"{setting}: {ours} here, {theirs} in the pods already registered")
        self.setting, self.theirs, self.ours = setting, theirs, ours


@dataclass(frozen=True, slots=True)
class RegisterResult:
    instance_id: str
    epoch: int
    version: int
    superseded: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    epoch: int
    state: InstanceState
    reason: str
    revived: bool  # was isolated by lease expiry or an unreachable probe, healthy again
    previous_reason: str = ""  # the reason it had before this heartbeat


@dataclass(frozen=True, slots=True)
class DeregisterResult:
    pipeline: str
    stage_id: int
    version: int


@dataclass(frozen=True, slots=True)
class StateChangeResult:
    state: InstanceState
    reason: str
    changed: bool


@dataclass(frozen=True, slots=True)
class SweepEvent:
    kind: str  # "expired" | "evicted"
    instance_id: str
    pipeline: str
    stage_id: int
    previous_state: str


@dataclass(frozen=True, slots=True)
class SweepResult:
    held_lock: bool
    events: tuple[SweepEvent, ...] = ()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _record_to_info(record: Sequence[Any], now_ms: int) -> InstanceInfo | None:
    """``{id, field, value, ...}`` from the SNAPSHOT script -> InstanceInfo (None if corrupt)."""
    instance_id = _text(record[0])
    fields = {_text(record[i]): _text(record[i + 1]) for i in range(1, len(record) - 1, 2)}
    try:
        last = int(fields["last_heartbeat_ms"])
        return InstanceInfo(
            instance_id=instance_id,
            pipeline=fields["pipeline"],
            stage_id=int(fields["stage_id"]),
            address=fields["address"],
            host_id=fields["host_id"],
            capacity=int(fields["capacity"]),
            labels=json.loads(fields["labels"] or "{}"),
            state=InstanceState(fields["state"]),
            reason=fields.get("reason", ""),
            epoch=int(fields["epoch"]),
            registered_at_ms=int(fields["registered_at_ms"]),
            last_heartbeat_ms=last,
            heartbeat_age_ms=max(0, now_ms - last),
            load=LoadReport.model_validate_json(fields["load"] or "{}"),
        )
    except (KeyError, ValueError, ValidationError) as exc:
        logger.warning("skipping corrupt instance record instance=%s: %s", instance_id, exc)
        return None


class InstanceStore:
    """Atomic operations on instance records, pools, leases and versions."""

    def __init__(
        self,
        redis: Redis,
        keys: KeySchema | None = None,
        *,
        lease_ttl_ms: int,
        evict_after_ms: int,
        readmit_grace_ms: int = UNREACHABLE_READMIT_GRACE_MS,
    ) -> None:
        self.redis = redis
        self.keys = keys or KeySchema()
        self.lease_ttl_ms = lease_ttl_ms
        self.evict_after_ms = evict_after_ms
        self.readmit_grace_ms = readmit_grace_ms
        self._register = redis.register_script(scripts.REGISTER)
        self._heartbeat = redis.register_script(scripts.HEARTBEAT)
        self._deregister = redis.register_script(scripts.DEREGISTER)
        self._set_state = redis.register_script(scripts.SET_STATE)
        self._isolate_if_healthy = redis.register_script(scripts.ISOLATE_IF_HEALTHY)
        self._sweep = redis.register_script(scripts.SWEEP)
        self._acquire = redis.register_script(scripts.ACQUIRE_LOCK)
        self._release = redis.register_script(scripts.RELEASE_LOCK)
        self._snapshot = redis.register_script(scripts.SNAPSHOT)
        self.scale = ScaleStore(redis, self.keys)  # autoscaling state (omni:scale:*)
        self.sessions = SessionStore(redis, self.keys)  # realtime sessions (omni:session:*)

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # ---- membership ------------------------------------------------------------------------

    async def register(
        self, request: RegisterRequest, stage_ids: Collection[int] = ()
    ) -> RegisterResult:
        """Add the instance to its pool; :class:`SettingsConflict` when its pipeline-wide
        ``settings`` disagree with those of the pipeline's live instances (``stage_ids``: every
        stage of the pipeline, whose pools hold them)."""
        k = self.keys
        instance_id = uuid.uuid4().hex
        pools = [k.pool(request.pipeline, s) for s in sorted(set(stage_ids) | {request.stage_id})]
        pools.append(k.api_pool(request.pipeline))
        own = (
            k.api_pool(request.pipeline)
            if request.role == "api"
            else k.pool(request.pipeline, request.stage_id)
        )
        load = LoadReport(capacity=request.capacity)
        res = await self._register(
            keys=[
                k.instance(instance_id),
                own,
                k.leases,
                k.version(request.pipeline),
                k.epoch,
                k.pipelines,
                k.evict,
                k.fingerprint(request.pipeline),
                *pools,
            ],
            args=[
                instance_id,
                request.pipeline,
                request.stage_id,
                request.address,
                request.effective_host_id,
                request.capacity,
                json.dumps(request.labels, separators=(",", ":"), sort_keys=True),
                load.model_dump_json(),
                self.lease_ttl_ms,
                k.channel(request.pipeline),
                k.instance_prefix,
                RECORD_SCHEMA_VERSION,
                json.dumps(request.settings, separators=(",", ":"), sort_keys=True),
                InstanceState.STANDBY.value if request.standby else InstanceState.HEALTHY.value,
            ],
        )
        if _text(res[0]) == "conflict":
            raise SettingsConflict(_text(res[1]), _text(res[2]), _text(res[3]))
        return RegisterResult(
            instance_id=instance_id,
            epoch=int(res[0]),
            version=int(res[1]),
            superseded=tuple(_text(x) for x in res[3]),
        )

    async def heartbeat(self, instance_id: str, load: LoadReport) -> HeartbeatResult | None:
        """Renew the lease (None: unknown instance). :class:`SettingsConflict` when the
        instance comes back after its lease lapsed and the pipeline's fingerprint changed
        while it was away (another pipeline configuration registered)."""
        k = self.keys
        res = await self._heartbeat(
            keys=[k.instance(instance_id), k.leases, k.evict],
            args=[
                instance_id,
                load.model_dump_json(),
                self.lease_ttl_ms,
                k.version_prefix,
                k.channel_prefix,
                REASON_UNREACHABLE,
                self.readmit_grace_ms,
                k.fingerprint_prefix,
            ],
        )
        if int(res[0]) == 0:
            return None
        if int(res[0]) == 2:
            raise SettingsConflict(_text(res[1]), _text(res[2]), _text(res[3]))
        return HeartbeatResult(
            epoch=int(res[1]),
            state=InstanceState(_text(res[2])),
            reason=_text(res[3]),
            revived=bool(int(res[4])),
            previous_reason=_text(res[5]),
        )

    async def deregister(self, instance_id: str) -> DeregisterResult | None:
        k = self.keys
        res = await self._deregister(
            keys=[k.instance(instance_id), k.leases, k.evict],
            args=[instance_id, k.pool_prefix, k.version_prefix, k.channel_prefix],
        )
        if int(res[0]) == 0:
            return None
        return DeregisterResult(pipeline=_text(res[1]), stage_id=int(res[2]), version=int(res[3]))

    async def set_state(
        self, instance_id: str, action: StateAction, reason: str = ""
    ) -> StateChangeResult | None:
        k = self.keys
        res = await self._set_state(
            keys=[k.instance(instance_id), k.leases],
            args=[instance_id, action.value, reason, k.version_prefix, k.channel_prefix],
        )
        if int(res[0]) == 0:
            return None
        return StateChangeResult(
            state=InstanceState(_text(res[1])), reason=_text(res[2]), changed=bool(int(res[3]))
        )

    async def isolate_unreachable(self, instance_id: str) -> StateChangeResult | None:
        """Isolate a healthy instance that a probe could not reach (reason ``unreachable``):
        atomic, bumps the version and publishes. A draining or isolated instance is left as it
        is (``changed`` False). None when unknown."""
        k = self.keys
        res = await self._isolate_if_healthy(
            keys=[k.instance(instance_id)],
            args=[instance_id, REASON_UNREACHABLE, k.version_prefix, k.channel_prefix],
        )
        if int(res[0]) == 0:
            return None
        return StateChangeResult(
            state=InstanceState(_text(res[1])), reason=_text(res[2]), changed=bool(int(res[3]))
        )

    # ---- reads -----------------------------------------------------------------------------

    async def _read_pools(
        self,
        pipeline: str,
        stage_ids: Sequence[int],
        *,
        healthy_only: bool,
        api_servers: bool = False,
    ) -> tuple[int, list[list[InstanceInfo]]]:
        """The version and the pools of ``stage_ids`` (then the API servers' when asked)."""
        k = self.keys
        extra = [k.api_pool(pipeline)] if api_servers else []
        res = await self._snapshot(
            keys=[k.version(pipeline), *(k.pool(pipeline, s) for s in stage_ids), *extra],
            args=[k.instance_prefix, "1" if healthy_only else "0"],
        )
        version, now_ms = int(res[0]), int(res[1])
        pools: list[list[InstanceInfo]] = []
        for records in res[2:]:
            infos = (_record_to_info(r, now_ms) for r in records)
            pools.append(sorted((i for i in infos if i), key=lambda i: i.registered_at_ms))
        return version, pools

    async def pool(self, pipeline: str, stage_id: int, *, healthy_only: bool) -> PoolSnapshot:
        version, pools = await self._read_pools(pipeline, [stage_id], healthy_only=healthy_only)
        return PoolSnapshot(
            pipeline=pipeline, stage_id=stage_id, version=version, instances=tuple(pools[0])
        )

    async def snapshot(self, spec: PipelineSpec) -> PipelineSnapshot:
        """The pipeline's version and healthy pools, read atomically."""
        stage_ids = sorted(spec.stage_ids)
        version, pools = await self._read_pools(spec.name, stage_ids, healthy_only=True)
        return PipelineSnapshot(
            pipeline=spec.name,
            version=version,
            stages={s: tuple(p) for s, p in zip(stage_ids, pools, strict=True)},
        )

    async def pipeline_status(self, spec: PipelineSpec) -> PipelineStatus:
        """Every instance of the pipeline, whatever its state."""
        stage_ids = sorted(spec.stage_ids)
        version, pools = await self._read_pools(
            spec.name, stage_ids, healthy_only=False, api_servers=True
        )
        return PipelineStatus(
            pipeline=spec.name,
            version=version,
            instances=tuple(i for pool in pools[:-1] for i in pool),
            api_servers=tuple(pools[-1]),
        )

    async def api_servers(self, pipeline: str, stage_ids: Sequence[int]) -> list[InstanceInfo]:
        """The pipeline's live API servers, read atomically: those running no stage
        (``--api-only``) and the pods of ``stage_ids`` that serve the client API too (label
        ``role=api``); isolated ones left out."""
        _, pools = await self._read_pools(
            pipeline, sorted(set(stage_ids)), healthy_only=False, api_servers=True
        )
        serving = [i for pool in pools[:-1] for i in pool if i.labels.get("role") == "api"]
        return [
            i
            for i in (*pools[-1], *serving)
            if i.state in (InstanceState.HEALTHY, InstanceState.DRAINING)
        ]

    async def pipeline_names(self) -> list[str]:
        return sorted(_text(n) for n in await self.redis.smembers(self.keys.pipelines))

    async def instance(self, instance_id: str) -> InstanceInfo | None:
        """One instance record, any state (None when unknown)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.keys.instance(instance_id))
            pipe.time()
            fields, (seconds, micros) = await pipe.execute()
        if not fields:
            return None
        flat: list[Any] = [instance_id]
        for name, value in fields.items():
            flat.extend((name, value))
        return _record_to_info(flat, int(seconds) * 1000 + int(micros) // 1000)

    # ---- liveness sweeper ------------------------------------------------------------------

    async def try_acquire_sweeper_lock(self, token: str, ttl_ms: int) -> bool:
        """Take the lock if free (``SET NX PX``) or renew it if ``token`` holds it already."""
        return bool(await self._acquire(keys=[self.keys.sweeper_lock], args=[token, ttl_ms]))

    async def release_sweeper_lock(self, token: str) -> bool:
        return bool(await self._release(keys=[self.keys.sweeper_lock], args=[token]))

    async def sweep(self, token: str, lock_ttl_ms: int, limit: int = 512) -> SweepResult:
        """Expire lapsed leases and evict long-dead records, if ``token`` holds the lock."""
        k = self.keys
        res = await self._sweep(
            keys=[k.sweeper_lock, k.leases, k.evict],
            args=[token, lock_ttl_ms, self.evict_after_ms, limit, *k.lua_prefixes()],
        )
        if int(res[0]) == 0:
            return SweepResult(held_lock=False)
        events = tuple(
            SweepEvent(
                kind=_text(e[0]),
                instance_id=_text(e[1]),
                pipeline=_text(e[2]),
                stage_id=int(e[3]),
                previous_state=_text(e[4]),
            )
            for e in res[1]
        )
        return SweepResult(held_lock=True, events=events)
