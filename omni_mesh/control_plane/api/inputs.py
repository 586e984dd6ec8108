"""Parsing of untrusted request input: bodies, path and query parameters, pipeline lookups.

Everything here raises an :class:`~omni_mesh.control_plane.errors.ApiError` that names the field
at fault (and the stage where there is one), never anything that becomes a 500.
"""

from __future__ import annotations

import re
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from omni_mesh.configs.pipeline_spec import PipelineSpec, UnknownPipelineError, UnknownStageError
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.errors import BadRequestError, NotFoundError, PayloadTooLargeError
from omni_mesh.control_plane.schema import MAX_BODY_BYTES

M = TypeVar("M", bound=BaseModel)

_INSTANCE_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def describe_validation_error(exc: ValidationError) -> tuple[str, str]:
    """(message, field) for the first error of ``exc``; the field is a dotted path or "body"."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    field = ".".join(str(part) for part in first["loc"]) or "body"
    kind = first["type"]
    if kind == "json_invalid":
        message = f"body is not valid JSON ({first['msg']})"
    elif kind in ("model_type", "model_attributes_type"):
        message = "body must be a JSON object"
    elif kind == "extra_forbidden":
        message = f"{field}: unknown field"
    elif kind == "missing":
        message = f"{field}: field required"
    elif kind == "value_error" and "error" in first.get("ctx", {}):
        message = f"{field}: {first['ctx']['error']}"
    else:
        message = f"{field}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, field


async def read_model(
    request: web.Request,
    model: type[M],
    *,
    allow_empty: bool = False,
    max_bytes: int = MAX_BODY_BYTES,
) -> M:
    """Read a bounded JSON-object body (at most ``max_bytes``) and validate it into ``model``."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise PayloadTooLargeError(
            f"request body is {length} bytes; the limit is {max_bytes}", field="body"
        )
    if max_bytes != request.client_max_size:
        request = request.clone(client_max_size=max_bytes)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLargeError(
            f"request body exceeds the limit of {max_bytes} bytes", field="body"
        ) from None
    except web.RequestPayloadError as exc:
        raise body_unreadable(request, exc) from None
    except ConnectionResetError:  # the client closed (or half-closed) before the body ended
        raise BadRequestError(
            "request body incomplete: the connection closed before the body ended",
            field="body",
            close_connection=True,
        ) from None
    if not raw.strip():
        if not allow_empty:
            raise BadRequestError("request body is empty; expected a JSON object", field="body")
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        message, field = describe_validation_error(exc)
        raise BadRequestError(message, field=field) from None


def body_unreadable(request: web.Request, exc: web.RequestPayloadError) -> BadRequestError:
    """The 400 for a body that cannot be read (data that does not decode as its declared
    ``Content-Encoding``, say). Framing errors (a bad chunk size) and an unsupported encoding
    (``br`` without Brotli) are answered by aiohttp's parser itself, before any handler runs.

    The connection is closed after the answer (its byte stream is out of step), and the
    unread rest of the body is abandoned: aiohttp would otherwise try to drain it after the
    answer, hit the same error again and log it as an unhandled exception.
    """
    cause = exc.__cause__
    detail = getattr(cause, "message", None) or str(cause or exc)
    detail = " ".join(str(detail).split())[:200] or type(exc).__name__
    if request.content.exception() is not None:
        request.content.feed_eof()
    return BadRequestError(
        f"request body could not be read: {detail}", field="body", close_connection=True
    )


def instance_id_param(request: web.Request) -> str:
    instance_id = request.match_info["id"]
    if not _INSTANCE_ID.fullmatch(instance_id):
        raise NotFoundError(f"unknown instance {instance_id[:80]!r}", field="instance_id")
    return instance_id


def lookup_pipeline(name: str, *, field: str = "pipeline") -> PipelineSpec:
    try:
        return get_pipeline(name)
    except UnknownPipelineError as exc:
        raise BadRequestError(f"{field}: {exc}", field=field) from None


def lookup_stage(spec: PipelineSpec, stage_id: int, *, field: str = "stage_id") -> int:
    try:
        return spec.stage(stage_id).stage_id
    except UnknownStageError as exc:
        raise BadRequestError(f"{field}: {exc}", field=field, stage=stage_id) from None


def int_param(raw: str, field: str, *, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise BadRequestError(
            f"{field}: expected an integer, got {raw[:40]!r}", field=field
        ) from None
    if not low <= value <= high:
        raise BadRequestError(f"{field}: must be in [{low}, {high}], got {value}", field=field)
    return value


def float_param(raw: str, field: str, *, low: float, high: float) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise BadRequestError(
            f"{field}: expected a number, got {raw[:40]!r}", field=field
        ) from None
    if not low <= value <= high:  # also rejects nan
        raise BadRequestError(
            f"{field}: must be in [{low:g}, {high:g}], got {raw[:40]}", field=field
        )
    return value


def bool_param(raw: str, field: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise BadRequestError(f"{field}: expected 1/0/true/false, got {raw[:40]!r}", field=field)
