"""``POST /v1/hop``: the orchestrated hand-off between stage sidecars (msgpack both ways).

The answer is one msgpack :class:`HopResult` when the request's outputs from this stage on are
whole, and a chunked stream of length-prefixed frames (``application/x-omni-hop-frames``) when
something downstream emits chunks (``async_chunk``): each frame is sent as soon as it exists.
"""

from __future__ import annotations

import hmac
import logging
import time

from aiohttp import web

from omni_mesh.data_plane import codec, framing, wire
from omni_mesh.data_plane.constants import HOP_FRAMES, MSGPACK
from omni_mesh.data_plane.kv_transfer import is_prefill
from omni_mesh.data_plane.messages import StageInput, transfer_key
from omni_mesh.observability.children import labelled
from omni_mesh.sidecar.admission.admit import admitted
from omni_mesh.sidecar.admission.outcomes import counted
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.errors import ApiError, bad_request
from omni_mesh.sidecar.hop.client import HOP_PATH, HOP_TOKEN_HEADER
from omni_mesh.sidecar.pod import Pod

logger = logging.getLogger(__name__)


async def hop(request: web.Request) -> web.StreamResponse:
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
    async with admitted(pod, transfer_key(si), "hop", si):
        with counted(pod, "hop") as execution:
            response, outcome = await _answer(request, pod, si)
            if outcome != "ok":
                execution.failed(outcome)
    labelled(pod.metrics.request_duration, *labels, "hop").observe(time.monotonic() - t0)
    return response


async def _answer(request: web.Request, pod: Pod, si: StageInput) -> tuple[web.StreamResponse, str]:
    """Run the chain from this stage; answer with one frame, or stream the frames.

    A failure after the stream started (this engine died, say) cuts the connection without
    the stream's end: the sender sees a broken stream and replays it on another replica,
    which is what it does when this whole pod dies."""
    assert pod.runner is not None
    labels = (pod.pipeline.name, str(pod.stage_id))
    response: web.StreamResponse | None = None
    outcome = "ok"
    frames = pod.runner.prefill(si) if is_prefill(si.kv_transfer) else pod.runner.run_stream(si)
    try:
        try:
            async for frame in frames:
                if frame.error is not None:
                    outcome = frame.error.code
                if response is None and not frame.more:  # whole: one answer, as ever
                    body = codec.encode(frame)
                    return web.Response(body=body, content_type=MSGPACK), outcome
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": HOP_FRAMES})
                    response.enable_chunked_encoding()
                    await response.prepare(request)
                await response.write(framing.encode_frame(frame))
                labelled(pod.metrics.hop_frames, *labels).inc()
        finally:
            await frames.aclose()  # (not contextlib.aclosing: this runs on every hop)
    except Exception as exc:
        if response is None:
            raise  # an ordinary error answer (a dead engine: 503, replayed by the sender)
        logger.warning(
            "request_id=%s: streamed hop answer cut after it started: %s: %s",
            si.request_id,
            type(exc).__name__,
            exc,
        )
        if request.transport is not None:
            request.transport.close()
        return response, "engine_error"
    if response is None:
        raise ApiError(500, f"stage {pod.stage_id}: the answer ended without a frame")
    await response.write_eof()
    return response, outcome


def add_routes(app: web.Application) -> None:
    app.router.add_post(HOP_PATH, hop)
