"""Errors as clients see them: :class:`ApiError` (status, message naming what is wrong, OpenAI
type), the mappings of stage errors and failed hand-offs to it, and the one error shape
(OpenAI's ``{"error": {message, type, param, code}}``). ``middleware.error_middleware`` answers
every error with it.

Bad input of any kind is a 4xx naming the field; a request-level failure from an engine travels
as data (:class:`StageError`) and is mapped here; only a bug gives a 500.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.messages import StageError
from omni_mesh.sidecar.hop.budget import HopUnavailable
from omni_mesh.sidecar.hop.shed import retry_after_in

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
        raise bad_request(f"invalid {what}: {exc.detail}", _field(exc.path)) from None


def _field(path: str | None) -> str | None:
    """The top-level field of msgspec's path (``$.n`` → ``n``, ``$.a[0].b`` → ``a``)."""
    if not path or not path.startswith("$."):
        return None
    return re.split(r"[.\[]", path[2:], maxsplit=1)[0] or None


_STAGE_ERROR_STATUS = {
    "bad_input": 400,
    "aborted": 499,
    "deadline": 504,
    "unavailable": 503,
    "shed": 503,  # a stage's admission queue refused it (overload)
    "engine_error": 500,
}


def from_stage_error(err: StageError) -> ApiError:
    status = _STAGE_ERROR_STATUS.get(err.code, 500)
    where = f"stage {err.stage_id}: " if err.stage_id >= 0 else ""
    headers = None
    if status == 503:  # a shed carries the shedding stage's Retry-After in its message
        retry_after_s = (retry_after_in(err.message) if err.code == "shed" else None) or 1.0
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return ApiError(status, f"{where}{err.message}", type_=err.code, headers=headers)


def error_body(err: ApiError) -> dict[str, object]:
    """An error as OpenAI sends it (``{message, type, param, code}``), in a body or an event."""
    return {"message": err.message, "type": err.type, "param": err.param, "code": err.status}


def error_response(err: ApiError) -> web.Response:
    """The JSON answer of an error: ``{"error": {message, type, param, code}}``."""
    return web.json_response({"error": error_body(err)}, status=err.status, headers=err.headers)


def hop_unavailable_error(exc: HopUnavailable) -> ApiError:
    """A hand-off no replica took in time: 503 with Retry-After; 504 when the deadline had
    passed before the hand-off was tried at all."""
    if exc.code == "deadline":
        return ApiError(504, str(exc), type_="deadline")
    retry_after = str(max(1, math.ceil(exc.retry_after_s)))
    type_ = "shed" if exc.code == "shed" else "unavailable"
    return ApiError(503, str(exc), type_=type_, headers={"Retry-After": retry_after})
