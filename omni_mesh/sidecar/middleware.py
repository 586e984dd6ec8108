"""The pod's aiohttp middlewares: every error answered in one JSON shape
(:func:`error_middleware`), and the client API's request metrics and header-time shedding
(:func:`api_metrics_middleware`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import Counter, Histogram

from omni_mesh.observability.metrics import SidecarMetrics
from omni_mesh.sidecar.engine_link.client import EngineBusyError, EngineDeadError
from omni_mesh.sidecar.errors import ApiError, error_response, hop_unavailable_error
from omni_mesh.sidecar.hop.budget import HopUnavailable

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: A header-time shed check (``EarlyShed.check``): the 503 to answer, or None to go on.
ShedCheck = Callable[[web.Request, str], web.Response | None]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if isinstance(exc, web.HTTPException) and exc.status < 400:
            raise  # a redirect or another non-error answer
        err = api_error_for(exc)
        if err is None:  # a bug: logged with its traceback, answered in the same JSON shape
            logger.exception("unhandled error on %s %s", request.method, request.path)
            err = internal_error()
        return error_response(err)


def api_error_for(exc: Exception) -> ApiError | None:
    """The error answer for ``exc`` raised by a handler; None for a bug (its caller logs
    the traceback and answers :func:`internal_error`)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"invalid body: {exc}")
    if isinstance(exc, msgspec.DecodeError):
        return ApiError(400, f"undecodable body: {exc}")
    if isinstance(exc, HopUnavailable):
        return hop_unavailable_error(exc)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), type_="unavailable")
    if isinstance(exc, EngineBusyError):
        return ApiError(429, str(exc), type_="rate_limit", headers={"Retry-After": "1"})
    if isinstance(exc, web.HTTPException):
        return ApiError(exc.status, exc.text or exc.reason)
    if isinstance(exc, RequestPayloadError | HttpProcessingError):
        # A body that cannot be read: bad compression, a truncated chunked body, …
        return ApiError(400, f"unreadable request body: {exc}", param="body")
    return None


def internal_error() -> ApiError:
    return ApiError(500, "internal error (logged)", type_="internal_error")


_API_ROUTES = frozenset(
    {
        "/v1/generate",
        "/v1/models",
        "/v1/audio/speech",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/images/generations",
        "/v1/run",
    }
)


#: Request keys the metrics middleware and the streaming routes share.
API_ROUTE = web.RequestKey("omni_api_route", str)  # the route template, for labels
API_STARTED = web.RequestKey("omni_api_started", float)  # time.monotonic() at arrival
STREAM_FAILED = web.RequestKey("omni_stream_failed", bool)  # broke off after its 200


def api_metrics_middleware(
    metrics: SidecarMetrics,
    shed_check: ShedCheck | None = None,
    sheddable: frozenset[str] = frozenset(),
) -> Any:
    """Client API requests by route template and status (outermost, so it sees the status
    the error middleware chose). A streamed answer that failed after its 200 went out counts
    as status 500: its client got an incomplete answer. On the ``sheddable`` routes
    ``shed_check`` runs first: a request the admission gate would shed is answered on its
    headers, its body never read (``admission/early_shed.py``)."""

    # Label children made once (a shed under a flood costs little more than its answer).
    requests: dict[tuple[str, int], Counter] = {}
    durations: dict[str, Histogram] = {}

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        if route not in _API_ROUTES:
            return await handler(request)
        t0 = time.monotonic()
        request[API_ROUTE] = route
        request[API_STARTED] = t0
        status = 500
        try:
            if shed_check is not None and route in sheddable:
                shed = shed_check(request, route)
                if shed is not None:
                    status = 503
                    return shed
            response = await handler(request)
            status = 500 if request.get(STREAM_FAILED) else response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            counter = requests.get((route, status))
            if counter is None:
                counter = requests[(route, status)] = metrics.api_requests.labels(
                    route, str(status)
                )
            counter.inc()
            duration = durations.get(route)
            if duration is None:
                duration = durations[route] = metrics.api_duration.labels(route)
            duration.observe(time.monotonic() - t0)

    return middleware
