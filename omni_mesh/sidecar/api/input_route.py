"""``POST /v1/hop/input``: the later chunks of a streamed input this pod's runner holds, for the
replica that runs the request (``sidecar/hop/input_stream.py``). The answer is a chunked stream
of frames, one :class:`StageInput` each, sent as the chunks come; it ends after the last chunk,
and is cut (the connection closed without the stream's end) when the runner stops holding the
stream before it: the puller then fails its request, whose sender is gone or gave up on it."""

from __future__ import annotations

from aiohttp import web

from omni_mesh.data_plane import codec, framing, wire
from omni_mesh.data_plane.constants import HOP_FRAMES
from omni_mesh.sidecar.api.hop_route import check_hop
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.errors import ApiError, bad_request
from omni_mesh.sidecar.hop.client import HOP_TOKEN_HEADER
from omni_mesh.sidecar.hop.input_stream import INPUT_PATH, InputPull

MAX_PULL_BODY = 4096


async def input_chunks(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    check_hop(pod, request.headers.get(HOP_TOKEN_HEADER, ""))
    body = await wire.read_body(request, max_bytes=MAX_PULL_BODY)
    try:
        pull = codec.decode(body, InputPull)
    except ValueError as exc:
        raise bad_request(f"input pull body: {exc}") from None
    held = pod.input_streams.get(pull.request_id, pull.stage_id)
    if held is None:
        raise ApiError(
            404,
            f"no streamed input of request {pull.request_id!r} for stage {pull.stage_id} "
            "is held here",
            type_="not_found_error",
        )
    response = web.StreamResponse(headers={"Content-Type": HOP_FRAMES})
    response.enable_chunked_encoding()
    await response.prepare(request)
    async for chunk in held.after(pull.from_chunk):
        await response.write(framing.encode_frame(chunk))
        if chunk.last:
            await response.write_eof()
            return response
    if request.transport is not None:  # dropped before its last chunk: cut, not ended
        request.transport.close()
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_post(INPUT_PATH, input_chunks)
