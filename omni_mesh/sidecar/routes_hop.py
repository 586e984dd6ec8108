"""``POST /v1/hop``: the orchestrated hand-off between stage sidecars (msgpack both ways)."""

from __future__ import annotations

import hmac
import logging
import time

from aiohttp import web

from omni_mesh.data_plane import codec, wire
from omni_mesh.data_plane.messages import HopResult, StageError, StageInput
from omni_mesh.sidecar.admission import admitted
from omni_mesh.sidecar.errors import ApiError, bad_request
from omni_mesh.sidecar.handoff import HOP_PATH, HOP_TOKEN_HEADER, HopUnavailable
from omni_mesh.sidecar.keys import POD

logger = logging.getLogger(__name__)


async def hop(request: web.Request) -> web.Response:
    pod = request.app[POD]
    if pod.runner is None:
        raise ApiError(404, "this instance runs no engine: hops go to stage pods")
    token = request.headers.get(HOP_TOKEN_HEADER, "")
    if not hmac.compare_digest(token.encode(), pod.hop_token.encode()):
        raise ApiError(
            401,
            f"hops need the {HOP_TOKEN_HEADER} header of this deployment "
            "(clients use /v1/run or the API routes)",
            type_="authentication_error",
        )
    body = await wire.read_body(request, max_bytes=pod.settings.max_body_bytes)
    try:
        si = codec.decode(body, StageInput)
    except ValueError as exc:
        raise bad_request(f"hop body: {exc}") from None
    if si.pipeline != pod.pipeline.name or si.stage_id != pod.stage_id:
        raise bad_request(
            f"hop for pipeline {si.pipeline!r} stage {si.stage_id} reached "
            f"{pod.pipeline.name!r} stage {pod.stage_id}",
            "stage_id",
        )
    t0 = time.monotonic()
    labels = (pod.pipeline.name, str(pod.stage_id))
    with admitted(pod, si.request_id, "hop"):
        try:
            result = await pod.runner.run_chain(si)
        except HopUnavailable as exc:
            result = HopResult(
                request_id=si.request_id,
                error=StageError(code="unavailable", message=str(exc), stage_id=exc.stage_id),
            )
    outcome = result.error.code if result.error else "ok"
    pod.metrics.requests.labels(*labels, "hop", outcome).inc()
    pod.metrics.request_duration.labels(*labels, "hop").observe(time.monotonic() - t0)
    return web.Response(body=codec.encode(result), content_type=wire.MSGPACK)


def add_routes(app: web.Application) -> None:
    app.router.add_post(HOP_PATH, hop)
