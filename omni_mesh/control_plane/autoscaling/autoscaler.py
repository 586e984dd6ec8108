"""The autoscaling loop around the pure policy (``policy.py``): run by the sweeper-lock holder
after each sweep, it reads every autoscaled stage's policy, last decision and ready replicas,
decides, and stores the decision (only while it holds the lock, checked in Redis). Also the
scrape-time refresh of the autoscaling gauges, which every omni-cp serves from Redis.
"""

from __future__ import annotations

import logging

from omni_mesh.control_plane.autoscaling.policy import decide, stage_inputs
from omni_mesh.control_plane.schema import (
    KV_ROLE_LABEL,
    InstanceInfo,
    InstanceState,
    ScaleDecision,
    ScaleDirection,
)
from omni_mesh.control_plane.store.instances import InstanceStore, StateAction
from omni_mesh.control_plane.store.scale import ScaleStore, StageScale
from omni_mesh.observability.metrics import AutoscaleMetrics

logger = logging.getLogger(__name__)


class Autoscaler:
    """Decides the desired replicas of every autoscaled stage; one :meth:`tick` per sweep."""

    def __init__(self, store: InstanceStore, scale: ScaleStore, metrics: AutoscaleMetrics) -> None:
        self._store = store
        self._scale = scale
        self._metrics = metrics

    async def tick(self, token: str) -> list[ScaleDecision]:
        """Decide every autoscaled stage; stops early if the lock turns out to be lost."""
        stages = await self._scale.stages()
        if not stages:
            return []
        now_ms = await self._scale.now_ms()
        decisions: list[ScaleDecision] = []
        for pipeline, stage_id in stages:
            scale = await self._scale.stage(pipeline, stage_id)
            if scale is None:
                continue
            pool = await self._store.pool(pipeline, stage_id, healthy_only=False)
            # A split stage scales its decode pool; its prefill pool keeps its size.
            scaled = [i for i in pool.instances if i.labels.get(KV_ROLE_LABEL) != "prefill"]
            ready = [i for i in scaled if i.state is InstanceState.HEALTHY]
            standby = sorted(  # oldest first (the epoch orders two of the same millisecond)
                (i for i in scaled if i.state is InstanceState.STANDBY),
                key=lambda i: (i.registered_at_ms, i.epoch),
            )
            inputs = stage_inputs(ready, scale.wake_waiting).model_copy(
                update={"standby": len(standby)}
            )
            decision = decide(scale.policy, inputs, scale.decision, now_ms).model_copy(
                update={"leader": token[:8]}
            )
            saved = await self._scale.save_decision(token, scale, decision)
            if saved == 0:
                logger.warning("autoscale: sweeper lock lost before deciding pipeline=%s", pipeline)
                break
            if saved > 0:
                self._record(scale, decision)
                decisions.append(decision)
                if inputs.ready > 0 and scale.wake_waiting > 0:  # the waiters are served
                    await self._scale.clear_wake(pipeline, stage_id)
                await self._promote(scale, inputs.ready, decision.desired, standby)
        return decisions

    async def _promote(
        self, scale: StageScale, ready: int, desired: int, standby: list[InstanceInfo]
    ) -> None:
        """Promote the oldest standbys into a pool with fewer ready replicas than desired:
        they serve from the next pool change their senders see, milliseconds from now.
        omni-up starts their replacements (as standbys) in the background."""
        for info in standby[: max(0, desired - ready)]:
            result = await self._store.set_state(info.instance_id, StateAction.PROMOTE)
            if result is None or not result.changed:
                continue  # gone, or no longer a standby (drained, isolated) since the read
            self._metrics.promotions.labels(scale.pipeline, str(scale.stage_id)).inc()
            logger.info(
                "autoscale promoted standby pipeline=%s stage=%s instance=%s address=%s "
                "(ready=%d desired=%d standby=%d before)",
                scale.pipeline,
                scale.stage_id,
                info.instance_id,
                info.address,
                ready,
                desired,
                len(standby),
            )

    def _record(self, scale: StageScale, d: ScaleDecision) -> None:
        labels = (scale.pipeline, str(scale.stage_id))
        self._metrics.decisions.labels(*labels, d.direction.value, d.reason).inc()
        level = logging.INFO if d.direction is not ScaleDirection.HOLD else logging.DEBUG
        logger.log(
            level,
            "autoscale %s pipeline=%s stage=%s desired=%d->%d reason=%s recommended=%d ready=%d "
            "utilization=%.2f in_flight=%d queued=%d latency_ms=%s kv_cache=%s wake=%d",
            d.direction.value,
            scale.pipeline,
            scale.stage_id,
            d.previous,
            d.desired,
            d.reason,
            d.recommended,
            d.inputs.ready,
            d.inputs.utilization,
            d.inputs.in_flight,
            d.inputs.queued,
            "-" if d.inputs.latency_ms is None else f"{d.inputs.latency_ms:.1f}",
            "-" if d.inputs.kv_cache_usage is None else f"{d.inputs.kv_cache_usage:.2f}",
            d.inputs.wake_waiting,
        )


async def refresh_gauges(scale_store: ScaleStore, metrics: AutoscaleMetrics) -> None:
    """Set the per-stage autoscaling gauges from the decisions stored in Redis."""
    scales = [await scale_store.stage(p, s) for p, s in await scale_store.stages()]
    for gauge in metrics.stage_gauges():
        gauge.clear()
    for scale in scales:
        if scale is None or scale.decision is None:
            continue
        d, labels = scale.decision, (scale.pipeline, str(scale.stage_id))
        metrics.desired.labels(*labels).set(d.desired)
        metrics.recommended.labels(*labels).set(d.recommended)
        metrics.ready.labels(*labels).set(d.inputs.ready)
        metrics.utilization.labels(*labels).set(d.inputs.utilization)
        metrics.queued.labels(*labels).set(d.inputs.queued)
        if d.inputs.latency_ms is not None:
            metrics.latency.labels(*labels).set(d.inputs.latency_ms / 1000.0)
        if d.inputs.kv_cache_usage is not None:
            metrics.kv_cache.labels(*labels).set(d.inputs.kv_cache_usage)
        metrics.standby.labels(*labels).set(d.inputs.standby)
