"""HTTP handlers of a stage's scale resource (autoscaling), served by every omni-cp:

    GET    /v1/pipelines/{p}/stages/{s}/scale        policy, desired, ready, last decision
    PUT    /v1/pipelines/{p}/stages/{s}/scale        set the policy (ScalePolicyRequest)
    DELETE /v1/pipelines/{p}/stages/{s}/scale        stop autoscaling the stage
    POST   /v1/pipelines/{p}/stages/{s}/scale/wake   requests wait for a stage at zero

Decisions are made by the sweeper-lock holder (``autoscaling/autoscaler.py``), not here.
"""

from __future__ import annotations

import logging

from aiohttp import web

from omni_mesh.control_plane.api import appkeys
from omni_mesh.control_plane.api.inputs import int_param, lookup_pipeline, lookup_stage, read_model
from omni_mesh.control_plane.autoscaling.policy import initial_decision, stage_inputs
from omni_mesh.control_plane.errors import NotFoundError
from omni_mesh.control_plane.schema import (
    KV_ROLE_LABEL,
    MAX_STAGE_ID,
    ScalePolicyRequest,
    ScaleStatus,
    WakeRequest,
)

logger = logging.getLogger(__name__)

SCALE_PATH = "/v1/pipelines/{pipeline}/stages/{stage_id}/scale"


def _stage(request: web.Request) -> tuple[str, int]:
    spec = lookup_pipeline(request.match_info["pipeline"])
    stage_id = int_param(request.match_info["stage_id"], "stage_id", low=0, high=MAX_STAGE_ID)
    lookup_stage(spec, stage_id)
    return spec.name, stage_id


def _not_autoscaled(pipeline: str, stage_id: int) -> NotFoundError:
    return NotFoundError(
        f"stage {stage_id} of pipeline {pipeline!r} has no autoscale policy "
        f"(PUT one on {SCALE_PATH.format(pipeline=pipeline, stage_id=stage_id)})",
        field="stage_id",
        stage=stage_id,
    )


async def _status(app: web.Application, pipeline: str, stage_id: int) -> ScaleStatus:
    store = app[appkeys.STORE]
    pool = await store.pool(pipeline, stage_id, healthy_only=True)
    scale = await store.scale.stage(pipeline, stage_id)
    decision = scale.decision if scale else None
    return ScaleStatus(
        pipeline=pipeline,
        stage_id=stage_id,
        policy=scale.policy if scale else None,
        desired=decision.desired if decision else None,
        # A split stage scales its decode pool: its prefill replicas are not counted.
        ready=sum(1 for i in pool.instances if i.labels.get(KV_ROLE_LABEL) != "prefill"),
        decision=decision,
    )


def _json(status: ScaleStatus) -> web.Response:
    return web.json_response(text=status.model_dump_json())


async def get_scale(request: web.Request) -> web.Response:
    pipeline, stage_id = _stage(request)
    return _json(await _status(request.app, pipeline, stage_id))


async def put_scale(request: web.Request) -> web.Response:
    pipeline, stage_id = _stage(request)
    body = await read_model(request, ScalePolicyRequest)
    store = request.app[appkeys.STORE]
    pool = await store.pool(pipeline, stage_id, healthy_only=True)
    now_ms = await store.scale.now_ms()
    initial = initial_decision(body.autoscale, stage_inputs(pool.instances), now_ms, body.replicas)
    created = await store.scale.put_policy(pipeline, stage_id, body.autoscale, initial)
    p = body.autoscale
    logger.info(
        "autoscale policy %s pipeline=%s stage=%s min=%d max=%d target=%.2f%s",
        "set" if created else "updated",
        pipeline,
        stage_id,
        p.min_replicas,
        p.max_replicas,
        p.target_utilization,
        f" starting desired={initial.desired}" if created else "",
    )
    return _json(await _status(request.app, pipeline, stage_id))


async def delete_scale(request: web.Request) -> web.Response:
    pipeline, stage_id = _stage(request)
    if not await request.app[appkeys.STORE].scale.delete_policy(pipeline, stage_id):
        raise _not_autoscaled(pipeline, stage_id)
    logger.info("autoscale policy removed pipeline=%s stage=%s", pipeline, stage_id)
    return web.Response(status=204)


async def wake(request: web.Request) -> web.Response:
    pipeline, stage_id = _stage(request)
    body = await read_model(request, WakeRequest, allow_empty=True)
    scale_store = request.app[appkeys.STORE].scale
    if await scale_store.stage(pipeline, stage_id) is None:
        raise _not_autoscaled(pipeline, stage_id)
    await scale_store.wake(pipeline, stage_id, body.waiting)
    logger.info("autoscale wake pipeline=%s stage=%s waiting=%d", pipeline, stage_id, body.waiting)
    return _json(await _status(request.app, pipeline, stage_id))


async def desired_counts(app: web.Application) -> dict[str, dict[int, int]]:
    """pipeline -> {stage id: desired replicas} of every autoscaled stage with a decision."""
    scale_store = app[appkeys.STORE].scale
    out: dict[str, dict[int, int]] = {}
    for pipeline, stage_id in await scale_store.stages():
        scale = await scale_store.stage(pipeline, stage_id)
        if scale is not None and scale.decision is not None:
            out.setdefault(pipeline, {})[stage_id] = scale.decision.desired
    return out


def add_routes(app: web.Application) -> None:
    app.router.add_get(SCALE_PATH, get_scale)
    app.router.add_put(SCALE_PATH, put_scale)
    app.router.add_delete(SCALE_PATH, delete_scale)
    app.router.add_post(SCALE_PATH + "/wake", wake)
