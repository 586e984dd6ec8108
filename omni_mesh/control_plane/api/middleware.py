"""aiohttp middlewares of omni-cp: request metrics, error mapping and bearer-token auth.

Order (outermost first): metrics -> errors -> auth. Every failure leaves as OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (the sidecars' shape too): a body that
cannot be read (data that does not decode as its ``Content-Encoding``) is a 400 naming the body,
Redis being unreachable is a 503 (its warnings rate-limited), and only a genuine bug is a 500 -
logged with its traceback, and still JSON.
"""

from __future__ import annotations

import hmac
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omni_mesh.control_plane.api.inputs import body_unreadable
from omni_mesh.control_plane.api.logthrottle import REDIS_UNAVAILABLE
from omni_mesh.control_plane.errors import ApiError, ServiceUnavailableError, UnauthorizedError
from omni_mesh.control_plane.schema import ErrorBody, ErrorDetail
from omni_mesh.observability.metrics import ControlPlaneMetrics

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/metrics"})
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client closed the connection"


def error_response(status: int, detail: ErrorDetail, **headers: str) -> web.Response:
    if detail.code is None:
        detail = detail.model_copy(update={"code": status})
    return web.json_response(
        text=ErrorBody(error=detail).model_dump_json(), status=status, headers=headers or None
    )


def route_label(request: web.Request) -> str:
    """The route template ("/v1/instances/{id}/heartbeat"), bounded cardinality."""
    resource = request.match_info.route.resource
    return "unmatched" if resource is None else resource.canonical


def metrics_middleware(metrics: ControlPlaneMetrics) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            metrics.request_duration.labels(
                route_label(request), request.method, str(status)
            ).observe(time.perf_counter() - started)

    return middleware


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _api_error_response(exc)
    except web.RequestPayloadError as exc:  # a handler read the body without read_model()
        return _api_error_response(body_unreadable(request, exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        detail = ErrorDetail(message=_http_message(request, exc), type=kind)
        return error_response(exc.status, detail, **headers)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        REDIS_UNAVAILABLE("redis unavailable: %s %s: %s", request.method, request.path, exc)
        err = ServiceUnavailableError(f"control plane storage (redis) unavailable: {exc}")
        return error_response(err.status, err.body().error, **{"Retry-After": "1"})
    except ConnectionResetError:
        # The client went away: nobody reads this answer, but returning one (rather than
        # raising) spares aiohttp's text/plain 500 and its ERROR traceback in the log.
        logger.debug("client went away: %s %s", request.method, request.path)
        response = error_response(
            CLIENT_CLOSED_REQUEST,
            ErrorDetail(message="client closed the connection", type="client_closed"),
        )
        response.force_close()
        return response
    except Exception:
        logger.exception("unhandled error: %s %s", request.method, request.path)
        detail = ErrorDetail(message="internal error (see omni-cp logs)", type="internal_error")
        return error_response(500, detail)


def _api_error_response(exc: ApiError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    response = error_response(exc.status, exc.body().error, **headers)
    if exc.close_connection:
        response.force_close()
    return response


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if isinstance(exc, web.HTTPNotFound):
        return f"no route for {request.method} {request.path}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return f"method {request.method} not allowed on {request.path}"
    return (exc.text or exc.reason).strip()


def auth_middleware(token: str | None) -> Middleware:
    """With a token configured, every route but /healthz and /metrics needs ``Bearer <token>``."""
    expected = None if token is None else f"Bearer {token}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not given:
                raise UnauthorizedError("missing bearer token", field="Authorization")
            if not hmac.compare_digest(given, expected):
                raise UnauthorizedError("invalid bearer token", field="Authorization")
        return await handler(request)

    return middleware
