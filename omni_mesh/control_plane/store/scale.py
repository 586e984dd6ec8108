"""Redis state of autoscaling: policies, decisions and wake hints of autoscaled stages, and of
the prefill pools of split stages that autoscale apart (:class:`ScalePool`; every method takes
the pool, the stage's own by default).

Policies have no expiry (a stage scaled to zero has no pod to carry its policy; the launcher
``PUT``s it again if Redis lost it). Decisions are written only by the sweeper-lock holder (the
Lua script checks the lock). A corrupt record is logged and treated as absent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.schema import ScaleDecision, ScalePool
from omni_mesh.control_plane.store import scripts
from omni_mesh.control_plane.store.keys import KeySchema

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

#: How long a wake hint (requests waiting for a stage at zero) counts, ms, unless the stage
#: gains a ready replica first (the autoscaler then clears it: those requests are served).
WAKE_TTL_MS = 10_000


@dataclass(frozen=True, slots=True)
class StageScale:
    """One autoscaled pool as stored: its policy (with the raw JSON the save script compares)
    and its last decision."""

    pipeline: str
    stage_id: int
    policy: AutoscaleConfig
    policy_json: str
    decision: ScaleDecision | None
    wake_waiting: int
    pool: ScalePool = ScalePool.STAGE

    @property
    def where(self) -> str:
        """``pipeline=P stage=N[ pool=prefill]`` for logs."""
        return f"pipeline={self.pipeline} {self.pool.where(self.stage_id)}"


def _str(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _parse(model: type[M], raw: str | None, what: str) -> M | None:
    if not raw:
        return None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        logger.warning("ignoring corrupt %s record: %s", what, exc)
        return None


class ScaleStore:
    """Reads and writes of the ``omni:scale:*`` keys."""

    def __init__(self, redis: Redis, keys: KeySchema) -> None:
        self.redis = redis
        self.keys = keys
        self._save = redis.register_script(scripts.SAVE_SCALE_DECISION)
        self._put = redis.register_script(scripts.PUT_SCALE_POLICY)

    async def now_ms(self) -> int:
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def put_policy(
        self,
        pipeline: str,
        stage_id: int,
        policy: AutoscaleConfig,
        initial: ScaleDecision,
        pool: ScalePool = ScalePool.STAGE,
    ) -> bool:
        """Store the policy (and ``initial`` where no decision exists). True if ``initial``
        was stored."""
        k = self.keys
        res = await self._put(
            keys=[
                k.scale_stages,
                k.scale_policy(pipeline, stage_id, pool),
                k.scale_decision(pipeline, stage_id, pool),
            ],
            args=[
                k.scale_member(pipeline, stage_id, pool),
                # Unset knobs left out: a control plane that predates a knob still reads the
                # policy (it refuses fields it does not know) while nobody sets it.
                policy.model_dump_json(exclude_none=True),
                initial.model_dump_json(),
            ],
        )
        return bool(int(res))

    async def delete_policy(
        self, pipeline: str, stage_id: int, pool: ScalePool = ScalePool.STAGE
    ) -> bool:
        """Forget the pool's policy, decision and wake hint. True if it had a policy."""
        k = self.keys
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(k.scale_policy(pipeline, stage_id, pool))
            pipe.delete(
                k.scale_decision(pipeline, stage_id, pool), k.scale_wake(pipeline, stage_id, pool)
            )
            pipe.srem(k.scale_stages, k.scale_member(pipeline, stage_id, pool))
            removed, _, _ = await pipe.execute()
        return bool(removed)

    async def wake(
        self, pipeline: str, stage_id: int, waiting: int, pool: ScalePool = ScalePool.STAGE
    ) -> None:
        """Record that ``waiting`` requests wait for the pool (kept for ``WAKE_TTL_MS``)."""
        key = self.keys.scale_wake(pipeline, stage_id, pool)
        await self.redis.set(key, str(waiting), px=WAKE_TTL_MS)

    async def clear_wake(
        self, pipeline: str, stage_id: int, pool: ScalePool = ScalePool.STAGE
    ) -> None:
        """Forget the stage's wake hint: it has a ready replica, so the requests that posted
        it are served; one that still waits posts it again. Left standing, a served hint would
        wake the stage again when it next drops to zero."""
        await self.redis.delete(self.keys.scale_wake(pipeline, stage_id, pool))

    async def stage(
        self, pipeline: str, stage_id: int, pool: ScalePool = ScalePool.STAGE
    ) -> StageScale | None:
        """The pool's policy and last decision; None when it is not autoscaled."""
        k = self.keys
        raw_policy, raw_decision, raw_wake = (
            _str(v)
            for v in await self.redis.mget(
                k.scale_policy(pipeline, stage_id, pool),
                k.scale_decision(pipeline, stage_id, pool),
                k.scale_wake(pipeline, stage_id, pool),
            )
        )
        where = f"pipeline={pipeline} {pool.where(stage_id)}"
        policy = _parse(AutoscaleConfig, raw_policy, f"scale policy {where}")
        if policy is None or raw_policy is None:
            return None
        return StageScale(
            pipeline=pipeline,
            stage_id=stage_id,
            policy=policy,
            policy_json=raw_policy,
            decision=_parse(ScaleDecision, raw_decision, f"scale decision {where}"),
            wake_waiting=int(raw_wake) if raw_wake and raw_wake.isdigit() else 0,
            pool=pool,
        )

    async def pools(self) -> list[tuple[str, int, ScalePool]]:
        """(pipeline, stage id, pool) of every autoscaled pool, sorted (a stage's own pool
        before its prefill pool)."""
        members = await self.redis.smembers(self.keys.scale_stages)
        parsed = (self.keys.parse_scale_member(_str(m) or "") for m in members)
        order = list(ScalePool)
        return sorted(
            (p for p in parsed if p is not None), key=lambda p: (p[0], p[1], order.index(p[2]))
        )

    async def stages(self) -> list[tuple[str, int]]:
        """(pipeline, stage id) of every autoscaled stage (its own pool), sorted."""
        return [(p, s) for p, s, pool in await self.pools() if pool is ScalePool.STAGE]

    async def save_decision(self, token: str, scale: StageScale, decision: ScaleDecision) -> int:
        """Store ``decision`` if ``token`` holds the sweeper lock and the policy is unchanged:
        1 stored, 0 lock not held, -1 policy changed or removed meanwhile."""
        k = self.keys
        res = await self._save(
            keys=[
                k.sweeper_lock,
                k.scale_policy(scale.pipeline, scale.stage_id, scale.pool),
                k.scale_decision(scale.pipeline, scale.stage_id, scale.pool),
            ],
            args=[token, decision.model_dump_json(), scale.policy_json],
        )
        return int(res)
