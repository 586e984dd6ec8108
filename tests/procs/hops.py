"""A hop sent straight to a stage pod, as a sender sidecar sends it (the deployment's secret
signs its token): for tests that hand a pod an input no client route makes (a prefill request,
a decode request with params of their own)."""

from __future__ import annotations

import urllib.request

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.constants import HOP_FRAMES, MSGPACK
from omni_mesh.data_plane.framing import HEADER
from omni_mesh.data_plane.messages import HopResult, StageInput
from omni_mesh.data_plane.signing import hop_token
from omni_mesh.sidecar.hop.client import HOP_PATH, HOP_TOKEN_HEADER


def send_hop(url: str, si: StageInput, secret: str) -> list[HopResult]:
    """``si`` sent to the pod at ``url``; the answer's frames."""
    headers = {"Content-Type": MSGPACK, HOP_TOKEN_HEADER: hop_token(secret.encode())}
    request = urllib.request.Request(f"{url}{HOP_PATH}", codec.encode(si), headers)
    with urllib.request.urlopen(request, timeout=60) as resp:
        body, streamed = resp.read(), resp.headers["Content-Type"] == HOP_FRAMES
    if not streamed:
        return [codec.decode(body, HopResult)]
    frames, off = [], 0
    while off < len(body):
        (size,) = HEADER.unpack_from(body, off)
        frames.append(codec.decode(body[off + HEADER.size : off + HEADER.size + size], HopResult))
        off += HEADER.size + size
    return frames


def hop_text(frames: list[HopResult], stage_id: int = 0) -> str:
    """The text of stage ``stage_id``'s final outputs in ``frames``, joined."""
    return "".join(
        str(f.outputs[stage_id].fields.get("text", "")) for f in frames if stage_id in f.outputs
    )
