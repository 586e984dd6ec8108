"""HTTP handlers of a stage's scale resource (autoscaling), served by every omni-cp:

    GET    /v1/pipelines/{p}/stages/{s}/scale        policy, desired, ready, last decision
    PUT    /v1/pipelines/{p}/stages/{s}/scale        set the policy (ScalePolicyRequest)
    DELETE /v1/pipelines/{p}/stages/{s}/scale        stop autoscaling the stage
    POST   /v1/pipelines/{p}/stages/{s}/scale/wake   requests wait for a stage at zero

Each takes ``?pool=prefill`` for a split stage's prefill pool, which autoscales apart from the
stage's own pool (its decode pool) with a policy and decision of its own; ``?pool=stage``
(``decode`` is the same) or no ``pool`` is the stage's own. A pool's ready count covers only
its own replicas (``kv_role=prefill`` or not).

Decisions are made by the sweeper-lock holder (``autoscaling/autoscaler.py``), not here.
"""

from __future__ import annotations

import logging

from aiohttp import web

from omni_mesh.control_plane.api import appkeys
from omni_mesh.control_plane.api.inputs import int_param, lookup_pipeline, lookup_stage, read_model
from omni_mesh.control_plane.autoscaling.policy import initial_decision, stage_inputs
from omni_mesh.control_plane.errors import BadRequestError, NotFoundError
from omni_mesh.control_plane.schema import (
    MAX_STAGE_ID,
    ScalePolicyRequest,
    ScalePool,
    ScaleStatus,
    WakeRequest,
)

logger = logging.getLogger(__name__)

SCALE_PATH = "/v1/pipelines/{pipeline}/stages/{stage_id}/scale"
#: Values of the ``pool`` query parameter: a split stage's decode pool is the stage's own.
POOL_NAMES = {"stage": ScalePool.STAGE, "decode": ScalePool.STAGE, "prefill": ScalePool.PREFILL}


def _stage(request: web.Request) -> tuple[str, int, ScalePool]:
    spec = lookup_pipeline(request.match_info["pipeline"])
    stage_id = int_param(request.match_info["stage_id"], "stage_id", low=0, high=MAX_STAGE_ID)
    lookup_stage(spec, stage_id)
    raw = request.query.get("pool", "stage")
    pool = POOL_NAMES.get(raw)
    if pool is None:
        raise BadRequestError(
            f"pool: expected one of {', '.join(POOL_NAMES)}, got {raw[:40]!r}",
            field="pool",
            stage=stage_id,
        )
    return spec.name, stage_id, pool


def _path(pipeline: str, stage_id: int, pool: ScalePool) -> str:
    path = SCALE_PATH.format(pipeline=pipeline, stage_id=stage_id)
    return path if pool is ScalePool.STAGE else f"{path}?pool={pool}"


def _not_autoscaled(pipeline: str, stage_id: int, pool: ScalePool) -> NotFoundError:
    what = "" if pool is ScalePool.STAGE else f"'s {pool} pool"
    return NotFoundError(
        f"stage {stage_id}{what} of pipeline {pipeline!r} has no autoscale policy "
        f"(PUT one on {_path(pipeline, stage_id, pool)})",
        field="stage_id",
        stage=stage_id,
    )


async def _status(
    app: web.Application, pipeline: str, stage_id: int, pool: ScalePool
) -> ScaleStatus:
    store = app[appkeys.STORE]
    instances = (await store.pool(pipeline, stage_id, healthy_only=True)).instances
    scale = await store.scale.stage(pipeline, stage_id, pool)
    decision = scale.decision if scale else None
    return ScaleStatus(
        pipeline=pipeline,
        stage_id=stage_id,
        pool=pool,
        policy=scale.policy if scale else None,
        desired=decision.desired if decision else None,
        # A split stage's pools are counted apart (kv_role=prefill or not).
        ready=sum(1 for i in instances if pool.holds(i.labels)),
        decision=decision,
    )


def _json(status: ScaleStatus) -> web.Response:
    return web.json_response(text=status.model_dump_json())


async def get_scale(request: web.Request) -> web.Response:
    pipeline, stage_id, pool = _stage(request)
    return _json(await _status(request.app, pipeline, stage_id, pool))


async def put_scale(request: web.Request) -> web.Response:
    pipeline, stage_id, pool = _stage(request)
    body = await read_model(request, ScalePolicyRequest)
    p = body.autoscale
    if pool is ScalePool.PREFILL and p.min_replicas < 1:
        raise BadRequestError(
            "autoscale.min_replicas: a prefill pool cannot scale to zero (the decode replicas "
            "prefill locally then, so no load would wake it); give at least 1",
            field="autoscale.min_replicas",
            stage=stage_id,
        )
    store = request.app[appkeys.STORE]
    instances = (await store.pool(pipeline, stage_id, healthy_only=True)).instances
    ready = [i for i in instances if pool.holds(i.labels)]
    now_ms = await store.scale.now_ms()
    initial = initial_decision(p, stage_inputs(ready), now_ms, body.replicas)
    created = await store.scale.put_policy(pipeline, stage_id, p, initial, pool)
    logger.info(
        "autoscale policy %s pipeline=%s %s min=%d max=%d target=%.2f%s",
        "set" if created else "updated",
        pipeline,
        pool.where(stage_id),
        p.min_replicas,
        p.max_replicas,
        p.target_utilization,
        f" starting desired={initial.desired}" if created else "",
    )
    return _json(await _status(request.app, pipeline, stage_id, pool))


async def delete_scale(request: web.Request) -> web.Response:
    pipeline, stage_id, pool = _stage(request)
    if not await request.app[appkeys.STORE].scale.delete_policy(pipeline, stage_id, pool):
        raise _not_autoscaled(pipeline, stage_id, pool)
    logger.info("autoscale policy removed pipeline=%s %s", pipeline, pool.where(stage_id))
    return web.Response(status=204)


async def wake(request: web.Request) -> web.Response:
    pipeline, stage_id, pool = _stage(request)
    body = await read_model(request, WakeRequest, allow_empty=True)
    scale_store = request.app[appkeys.STORE].scale
    if await scale_store.stage(pipeline, stage_id, pool) is None:
        raise _not_autoscaled(pipeline, stage_id, pool)
    await scale_store.wake(pipeline, stage_id, body.waiting, pool)
    logger.info(
        "autoscale wake pipeline=%s %s waiting=%d", pipeline, pool.where(stage_id), body.waiting
    )
    return _json(await _status(request.app, pipeline, stage_id, pool))


async def desired_counts(
    app: web.Application,
) -> dict[str, dict[ScalePool, dict[int, int]]]:
    """pipeline -> pool -> {stage id: desired replicas} of every autoscaled pool with a
    decision."""
    scale_store = app[appkeys.STORE].scale
    out: dict[str, dict[ScalePool, dict[int, int]]] = {}
    for pipeline, stage_id, pool in await scale_store.pools():
        scale = await scale_store.stage(pipeline, stage_id, pool)
        if scale is not None and scale.decision is not None:
            out.setdefault(pipeline, {}).setdefault(pool, {})[stage_id] = scale.decision.desired
    return out


def add_routes(app: web.Application) -> None:
    app.router.add_get(SCALE_PATH, get_scale)
    app.router.add_put(SCALE_PATH, put_scale)
    app.router.add_delete(SCALE_PATH, delete_scale)
    app.router.add_post(SCALE_PATH + "/wake", wake)
