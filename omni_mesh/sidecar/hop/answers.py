"""Reading replicas' hop answers: error bodies, shed answers, and the (stage, chunk) outputs a
replayed stream already passed on. Pure functions, used by :mod:`omni_mesh.sidecar.hop.client`."""

from __future__ import annotations

import contextlib

import msgspec

from omni_mesh.data_plane.messages import HopResult
from omni_mesh.sidecar.hop.shed import SHED_TYPE, shed_retry_after


def unseen(frame: HopResult, seen: set[tuple[int, int]]) -> HopResult:
    """``frame`` without the (stage, chunk) outputs already passed on (a replayed stream
    regenerates them); records the rest as seen."""
    if not frame.outputs:
        return frame
    fresh = {}
    for stage_id, payload in frame.outputs.items():
        key = (stage_id, frame.chunks.get(stage_id, 0))
        if key not in seen:
            seen.add(key)
            fresh[stage_id] = payload
    if len(fresh) == len(frame.outputs):
        return frame
    chunks = {k: v for k, v in frame.chunks.items() if k in fresh}
    return msgspec.structs.replace(frame, outputs=fresh, chunks=chunks)


def shed_retry_after_of(status: int, body: bytearray) -> float | None:
    """The Retry-After of a receiver's shed answer (its admission queue refused the work:
    not a replica failure); None for any other answer."""
    if status != 503 or not body.startswith(b'{"error"'):
        return None
    with contextlib.suppress(msgspec.DecodeError, KeyError, TypeError):
        error = msgspec.json.decode(body)["error"]
        if error["type"] == SHED_TYPE:
            return shed_retry_after(error["message"]) or 1.0
    return None


def error_message(body: bytearray) -> str:
    with contextlib.suppress(msgspec.DecodeError, KeyError, TypeError):
        message = msgspec.json.decode(body)["error"]["message"]
        if isinstance(message, str):
            return message
    return bytes(body[:500]).decode(errors="replace")
