"""The autoscaling loop around the pure policy (``policy.py``): run by the sweeper-lock holder
after each sweep, it reads every autoscaled pool's policy, last decision and ready replicas,
decides, and stores the decision (only while it holds the lock, checked in Redis). Also the
scrape-time refresh of the autoscaling gauges, which every omni-cp serves from Redis.

A pool is a stage's own (a split stage's decode pool: its replicas not labelled
``kv_role=prefill``) or a split stage's prefill pool (those labelled so), each with its own
policy and decision (:class:`~omni_mesh.control_plane.schema.ScalePool`): one pool's load never
sizes the other. The prefill pool's gauges carry the stage label ``N/prefill``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from omni_mesh.configs.pipeline_spec import UnknownPipelineError
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.autoscaling.audio_slo import first_audio_p95, realtime_factor_p5
from omni_mesh.control_plane.autoscaling.policy import decide, stage_inputs
from omni_mesh.control_plane.schema import (
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
    """Decides the desired replicas of every autoscaled pool; one :meth:`tick` per sweep."""

    def __init__(self, store: InstanceStore, scale: ScaleStore, metrics: AutoscaleMetrics) -> None:
        self._store = store
        self._scale = scale
        self._metrics = metrics

    async def tick(self, token: str) -> list[ScaleDecision]:
        """Decide every autoscaled pool; stops early if the lock turns out to be lost."""
        pools = await self._scale.pools()
        if not pools:
            return []
        now_ms = await self._scale.now_ms()
        decisions: list[ScaleDecision] = []
        for pipeline, stage_id, which in pools:
            scale = await self._scale.stage(pipeline, stage_id, which)
            if scale is None:
                continue
            pool = await self._store.pool(pipeline, stage_id, healthy_only=False)
            # A split stage's pools scale apart: each from its own replicas' figures only.
            scaled = [i for i in pool.instances if which.holds(i.labels)]
            ready = [i for i in scaled if i.state is InstanceState.HEALTHY]
            standby = sorted(  # oldest first (the epoch orders two of the same millisecond)
                (i for i in scaled if i.state is InstanceState.STANDBY),
                key=lambda i: (i.registered_at_ms, i.epoch),
            )
            inputs = stage_inputs(ready, scale.wake_waiting).model_copy(
                update={"standby": len(standby), **await self._audio_slo(scale)}
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
                    await self._scale.clear_wake(pipeline, stage_id, which)
                await self._promote(scale, inputs.ready, decision.desired, standby)
        return decisions

    async def _audio_slo(self, scale: StageScale) -> dict[str, object]:
        """The pipeline's first-audio p95 and real-time factor p5 from its API servers'
        windows, for a pool that targets one (``audio_slo.py``); nothing read for the others."""
        policy = scale.policy
        if policy.target_first_audio_p95_ms is None and policy.target_realtime_factor_p5 is None:
            return {}
        try:
            stage_ids: Sequence[int] = sorted(get_pipeline(scale.pipeline).stage_ids)
        except UnknownPipelineError:  # not registered here: its API-only servers still count
            stage_ids = [scale.stage_id]
        servers = await self._store.api_servers(scale.pipeline, stage_ids)
        p95_ms, samples = first_audio_p95(servers)
        return {
            "first_audio_p95_ms": p95_ms,
            "first_audio_samples": samples,
            "realtime_factor_p5": realtime_factor_p5(servers)[0],
        }

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
            self._metrics.promotions.labels(*_labels(scale)).inc()
            logger.info(
                "autoscale promoted standby %s instance=%s address=%s "
                "(ready=%d desired=%d standby=%d before)",
                scale.where,
                info.instance_id,
                info.address,
                ready,
                desired,
                len(standby),
            )

    def _record(self, scale: StageScale, d: ScaleDecision) -> None:
        self._metrics.decisions.labels(*_labels(scale), d.direction.value, d.reason).inc()
        level = logging.INFO if d.direction is not ScaleDirection.HOLD else logging.DEBUG
        logger.log(
            level,
            "autoscale %s %s desired=%d->%d reason=%s recommended=%d ready=%d "
            "utilization=%.2f in_flight=%d queued=%d latency_ms=%s queue_wait_ms=%s "
            "first_audio_p95_ms=%s rtf_p5=%s kv_cache=%s wake=%d",
            d.direction.value,
            scale.where,
            d.previous,
            d.desired,
            d.reason,
            d.recommended,
            d.inputs.ready,
            d.inputs.utilization,
            d.inputs.in_flight,
            d.inputs.queued,
            "-" if d.inputs.latency_ms is None else f"{d.inputs.latency_ms:.1f}",
            "-" if d.inputs.queue_wait_ms is None else f"{d.inputs.queue_wait_ms:.1f}",
            "-" if d.inputs.first_audio_p95_ms is None else f"{d.inputs.first_audio_p95_ms:.1f}",
            "-" if d.inputs.realtime_factor_p5 is None else f"{d.inputs.realtime_factor_p5:.2f}",
            "-" if d.inputs.kv_cache_usage is None else f"{d.inputs.kv_cache_usage:.2f}",
            d.inputs.wake_waiting,
        )


async def refresh_gauges(scale_store: ScaleStore, metrics: AutoscaleMetrics) -> None:
    """Set the per-pool autoscaling gauges from the decisions stored in Redis."""
    scales = [await scale_store.stage(p, s, pool) for p, s, pool in await scale_store.pools()]
    for gauge in metrics.stage_gauges():
        gauge.clear()
    for scale in scales:
        if scale is None or scale.decision is None:
            continue
        d, labels = scale.decision, _labels(scale)
        metrics.desired.labels(*labels).set(d.desired)
        metrics.recommended.labels(*labels).set(d.recommended)
        metrics.ready.labels(*labels).set(d.inputs.ready)
        metrics.utilization.labels(*labels).set(d.inputs.utilization)
        metrics.queued.labels(*labels).set(d.inputs.queued)
        if d.inputs.latency_ms is not None:
            metrics.latency.labels(*labels).set(d.inputs.latency_ms / 1000.0)
        if d.inputs.queue_wait_ms is not None:
            metrics.queue_wait.labels(*labels).set(d.inputs.queue_wait_ms / 1000.0)
        if d.inputs.first_audio_p95_ms is not None:
            metrics.first_audio.labels(*labels).set(d.inputs.first_audio_p95_ms / 1000.0)
        if d.inputs.realtime_factor_p5 is not None:
            metrics.realtime_factor.labels(*labels).set(d.inputs.realtime_factor_p5)
        if d.inputs.kv_cache_usage is not None:
            metrics.kv_cache.labels(*labels).set(d.inputs.kv_cache_usage)
        metrics.standby.labels(*labels).set(d.inputs.standby)


def _labels(scale: StageScale) -> tuple[str, str]:
    """(pipeline, stage) labels of a pool's metrics: stage ``N``, a prefill pool's ``N/prefill``."""
    return scale.pipeline, scale.pool.label(scale.stage_id)
