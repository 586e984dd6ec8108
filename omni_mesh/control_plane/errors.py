"""Errors of the control plane: those the server turns into HTTP answers, and those its client
raises. Neither kind imports aiohttp.web or redis, so sidecars can import this module freely.
"""

from __future__ import annotations

from typing import NamedTuple

from omni_mesh.control_plane.schema import ErrorBody, ErrorDetail

# ---- server side: raised by handlers, mapped to JSON answers by one middleware -----------------


class ApiError(Exception):
    """A failed request: becomes ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's
    shape, as the sidecars answer) with ``status``; ``param`` names the field at fault."""

    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None  # a machine-readable code ("session_fenced"); default: the status

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        stage: int | None = None,
        close_connection: bool = False,
    ):
        super().__init__(message)
        self.message = message
        self.field = field
        self.stage = stage
        self.close_connection = close_connection  # the request stream is broken: do not reuse

    def body(self) -> ErrorBody:
        detail = ErrorDetail(
            message=self.message, type=self.type, param=self.field, code=self.code or self.status
        )
        return ErrorBody(error=detail)


class BadRequestError(ApiError):
    status = 400


class UnauthorizedError(ApiError):
    status = 401
    type = "authentication_error"


class NotFoundError(ApiError):
    status = 404
    type = "not_found_error"


class ConflictError(ApiError):
    """409: the request disagrees with the state (a pod whose pipeline-wide settings differ
    from those of the pods already registered)."""

    status = 409
    type = "conflict"


class SessionFencedError(ConflictError):
    """409 ``session_fenced``: a write carrying an epoch that is not the session's (another API
    server claimed it since), or to a released session."""

    code = "session_fenced"


class PayloadTooLargeError(ApiError):
    status = 413


class ServiceUnavailableError(ApiError):
    status = 503
    type = "unavailable"


# ---- client side: raised by ControlPlaneClient ---------------------------------------------------


class ControlPlaneError(Exception):
    """Base of every error the control-plane client raises."""


class EndpointFailure(NamedTuple):
    """Why one control-plane URL gave no usable answer."""

    url: str
    problem: str  # "connection refused", "no answer within 2s", "storage unavailable", ...
    status: int | None = None  # the HTTP status when it answered (5xx)

    def describe(self) -> str:
        """One clause for a person: "cannot reach the control plane at URL: connection
        refused", "the control plane at URL answered HTTP 503: ..."."""
        if self.status is None:
            return f"cannot reach the control plane at {self.url}: {self.problem}"
        return f"the control plane at {self.url} answered HTTP {self.status}: {self.problem}"


class ControlPlaneUnavailableError(ControlPlaneError):
    """No control-plane URL answered (connection refused/reset, timeout, 5xx).

    ``failures`` says what went wrong with each URL, in the order they were tried.
    """

    def __init__(self, message: str, failures: tuple[EndpointFailure, ...] = ()) -> None:
        super().__init__(message)
        self.failures = failures

    def describe(self) -> str:
        """What went wrong, for a person (no exception reprs)."""
        if not self.failures:
            return f"control plane unreachable: {self}"
        return "; ".join(f.describe() for f in self.failures)


class ControlPlaneRequestError(ControlPlaneError):
    """The control plane refused the request (4xx); ``field``/``stage`` name what is wrong."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None = None,
        stage: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.field = field
        self.stage = stage
        self.code = code  # the answer's string error code, when it has one


class ControlPlaneAuthError(ControlPlaneRequestError):
    """401: missing or wrong bearer token."""


class InstanceUnknownError(ControlPlaneRequestError):
    """404 on an instance route: the control plane does not know the id (re-register)."""


class SessionNotFound(ControlPlaneRequestError):
    """404 on a session route: the session does not exist (never created, deleted or expired)."""


class SessionFenced(ControlPlaneRequestError):
    """409 ``session_fenced``: the session was claimed by another owner since this one's claim
    (or released): this owner must stop writing it."""
