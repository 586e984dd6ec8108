"""One middleware maps every error to a JSON response (OpenAI's error shape).

Bad input of any kind is a 4xx naming the field; a request-level failure from an engine travels
as data (:class:`StageError`) and is mapped here; only a bug gives a 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.messages import StageError
from omni_mesh.observability.metrics import SidecarMetrics
from omni_mesh.sidecar.engine_client import EngineBusyError, EngineDeadError
from omni_mesh.sidecar.hop_client import HopUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An error with an HTTP status, a message naming what is wrong, and an OpenAI type."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def decode_body(body: bytearray, type_: type[T], *, what: str, binary: bool = False) -> T:
    """``body`` (msgpack when ``binary``, else JSON) decoded as ``type_`` through the codec;
    a 400 naming what is wrong otherwise."""
    try:
        return codec.decode(body, type_) if binary else codec.decode_json(body, type_)
    except codec.CodecError as exc:
        if exc.malformed:
            kind = "msgpack" if binary else "JSON"
            raise bad_request(f"{what} is not valid {kind}: {exc.detail}") from None
        raise bad_request(f"invalid {what}: {exc.detail}") from None


_STAGE_ERROR_STATUS = {
    "bad_input": 400,
    "aborted": 499,
    "deadline": 504,
    "unavailable": 503,
    "engine_error": 500,
}


def from_stage_error(err: StageError) -> ApiError:
    status = _STAGE_ERROR_STATUS.get(err.code, 500)
    where = f"stage {err.stage_id}: " if err.stage_id >= 0 else ""
    headers = {"Retry-After": "1"} if status == 503 else None
    return ApiError(status, f"{where}{err.message}", type_=err.code, headers=headers)


def error_response(err: ApiError) -> web.Response:
    body = {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}
    }
    return web.json_response(body, status=err.status, headers=err.headers)


def hop_unavailable_error(exc: HopUnavailable) -> ApiError:
    """A hand-off no replica took in time: 503 with Retry-After; 504 when the deadline had
    passed before the hand-off was tried at all."""
    if exc.code == "deadline":
        return ApiError(504, str(exc), type_="deadline")
    retry_after = str(max(1, round(exc.retry_after_s)))
    return ApiError(503, str(exc), type_="unavailable", headers={"Retry-After": retry_after})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except msgspec.ValidationError as exc:
        return error_response(ApiError(400, f"invalid body: {exc}"))
    except msgspec.DecodeError as exc:
        return error_response(ApiError(400, f"undecodable body: {exc}"))
    except HopUnavailable as exc:
        return error_response(hop_unavailable_error(exc))
    except EngineDeadError as exc:
        return error_response(ApiError(503, str(exc), type_="unavailable"))
    except EngineBusyError as exc:
        return error_response(
            ApiError(429, str(exc), type_="rate_limit", headers={"Retry-After": "1"})
        )
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(ApiError(exc.status, exc.text or exc.reason))
        raise
    except (RequestPayloadError, HttpProcessingError) as exc:
        # A body that cannot be read: bad compression, a truncated chunked body, …
        return error_response(ApiError(400, f"unreadable request body: {exc}", param="body"))
    except asyncio.CancelledError:
        raise
    except Exception:
        # A bug: logged with its traceback, answered in the same JSON shape.
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal error (logged)", type_="internal_error"))


_API_ROUTES = frozenset(
    {
        "/v1/generate",
        "/v1/models",
        "/v1/audio/speech",
        "/v1/chat/completions",
        "/v1/images/generations",
        "/v1/run",
    }
)


#: Request keys the metrics middleware and the streaming routes share.
API_ROUTE = web.RequestKey("omni_api_route", str)  # the route template, for labels
API_STARTED = web.RequestKey("omni_api_started", float)  # time.monotonic() at arrival
STREAM_FAILED = web.RequestKey("omni_stream_failed", bool)  # broke off after its 200


def api_metrics_middleware(metrics: SidecarMetrics) -> Any:
    """Client API requests by route template and status (outermost, so it sees the status
    the error middleware chose). A streamed answer that failed after its 200 went out counts
    as status 500: its client got an incomplete answer."""

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
            metrics.api_requests.labels(route, str(status)).inc()
            metrics.api_duration.labels(route).observe(time.monotonic() - t0)

    return middleware
