"""``POST /v1/hop``: the orchestrated hand-off between stage sidecars (msgpack both ways).

The answer is one msgpack :class:`HopResult` when the request's outputs from this stage on are
whole, and a chunked stream of length-prefixed frames (``application/x-omni-hop-frames``) when
something downstream emits chunks (``async_chunk``): each frame is sent as soon as it exists.

A hop is served by :func:`serve_hop`, which writes its answer through a :class:`HopAnswer`.
Two front ends call it: the lean HTTP/1.1 protocol that takes the pod's connections first
(``api/hop_server.py``, every plain hop), and the aiohttp route below, which gets a hop only
when its connection was handed to aiohttp (a chunked or compressed body, say).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Protocol

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


class HopAnswer(Protocol):
    """Where a hop's answer goes: one whole body, or a stream of frames."""

    def whole(self, body: bytes) -> None:
        """The whole answer (a msgpack ``HopResult``)."""

    async def frame(self, frame: bytes | bytearray) -> None:
        """One frame of a streamed answer (the first starts the stream)."""

    async def end(self) -> None:
        """The streamed answer's end."""

    def cut(self) -> None:
        """Break a started stream off: close the connection without the stream's end."""


def check_hop(pod: Pod, token: str) -> None:
    """A hop needs a stage pod and this deployment's hop token (checked before the body is
    read)."""
    if pod.runner is None:
        raise ApiError(404, "this instance runs no engine: hops go to stage pods")
    if not hmac.compare_digest(token.encode(), pod.hop_token.encode()):
        raise ApiError(
            401,
            f"hops need the {HOP_TOKEN_HEADER} header of this deployment "
            "(clients use /v1/run or the API routes)",
            type_="authentication_error",
        )


async def serve_hop(pod: Pod, body: bytes | bytearray, answer: HopAnswer) -> None:
    """Run the chain from this stage for the hop ``body`` and answer it. Raises (an
    :class:`ApiError`, a dead engine's error, …) only before the answer started."""
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
            outcome = await _answer(pod, si, answer)
            if outcome != "ok":
                execution.failed(outcome)
    labelled(pod.metrics.request_duration, *labels, "hop").observe(time.monotonic() - t0)


async def _answer(pod: Pod, si: StageInput, answer: HopAnswer) -> str:
    """Run the chain from this stage; answer with one frame, or stream the frames.

    A failure after the stream started (this engine died, say) cuts the connection without
    the stream's end: the sender sees a broken stream and replays it on another replica,
    which is what it does when this whole pod dies."""
    assert pod.runner is not None
    labels = (pod.pipeline.name, str(pod.stage_id))
    streaming = False
    outcome = "ok"
    whole: bytes | None = None
    frames = pod.runner.prefill(si) if is_prefill(si.kv_transfer) else pod.runner.run_stream(si)
    try:
        try:
            async for frame in frames:
                if frame.error is not None:
                    outcome = frame.error.code
                if not streaming and not frame.more:  # whole: one answer, as ever
                    whole = codec.encode(frame)
                    break
                streaming = True
                await answer.frame(framing.encode_frame(frame))
                labelled(pod.metrics.hop_frames, *labels).inc()
        finally:
            await frames.aclose()  # (not contextlib.aclosing: this runs on every hop)
        if whole is not None:  # sent once the chain is closed: nothing can fail after it
            answer.whole(whole)
            return outcome
    except Exception as exc:
        if not streaming:
            raise  # an ordinary error answer (a dead engine: 503, replayed by the sender)
        logger.warning(
            "request_id=%s: streamed hop answer cut after it started: %s: %s",
            si.request_id,
            type(exc).__name__,
            exc,
        )
        answer.cut()
        return "engine_error"
    if not streaming:
        raise ApiError(500, f"stage {pod.stage_id}: the answer ended without a frame")
    await answer.end()
    return outcome


class _WebAnswer:
    """A hop's answer through aiohttp."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    def whole(self, body: bytes) -> None:
        self.response = web.Response(body=body, content_type=MSGPACK)

    async def frame(self, frame: bytes | bytearray) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers={"Content-Type": HOP_FRAMES})
            self.response.enable_chunked_encoding()
            await self.response.prepare(self.request)
        await self.response.write(frame)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    def cut(self) -> None:
        if self.request.transport is not None:
            self.request.transport.close()


async def hop(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    check_hop(pod, request.headers.get(HOP_TOKEN_HEADER, ""))
    body = await wire.read_body(request, max_bytes=pod.settings.max_body_bytes)
    answer = _WebAnswer(request)
    await serve_hop(pod, body, answer)
    assert answer.response is not None
    return answer.response


def add_routes(app: web.Application) -> None:
    app.router.add_post(HOP_PATH, hop)
