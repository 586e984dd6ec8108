"""A request's deadline budget, as a client may set it."""

from __future__ import annotations

from aiohttp import web

from omni_mesh.sidecar.errors import bad_request
from omni_mesh.sidecar.pod import Pod

TIMEOUT_HEADER = "X-Omni-Timeout-S"


def request_timeout(pod: Pod, request: web.Request) -> float:
    """The request's deadline budget: ``X-Omni-Timeout-S`` or the deploy config's default."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return pod.request_timeout_s()
    try:
        value = float(raw)
    except ValueError:
        raise bad_request("X-Omni-Timeout-S: not a number", "X-Omni-Timeout-S") from None
    if not 0.05 <= value <= 3600:
        raise bad_request("X-Omni-Timeout-S: must be within [0.05, 3600]", "X-Omni-Timeout-S")
    return value
