"""Errors of the control plane: those the server turns into HTTP answers, and those its client
raises. Neither kind imports aiohttp.web or redis, so sidecars can import this module freely.
"""

from __future__ import annotations

from omni_mesh.control_plane.schema import ErrorBody, ErrorDetail

# ---- server side: raised by handlers, mapped to JSON answers by one middleware -----------------


class ApiError(Exception):
    """A failed request: becomes ``{"error": {...}}`` with ``status``."""

    status: int = 400

    def __init__(self, message: str, *, field: str | None = None, stage: int | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.stage = stage

    def body(self) -> ErrorBody:
        return ErrorBody(
            error=ErrorDetail(message=self.message, field=self.field, stage=self.stage)
        )


class BadRequestError(ApiError):
    status = 400


class UnauthorizedError(ApiError):
    status = 401


class NotFoundError(ApiError):
    status = 404


class PayloadTooLargeError(ApiError):
    status = 413


class ServiceUnavailableError(ApiError):
    status = 503


# ---- client side: raised by ControlPlaneClient ---------------------------------------------------


class ControlPlaneError(Exception):
    """Base of every error the control-plane client raises."""


class ControlPlaneUnavailableError(ControlPlaneError):
    """No control-plane URL answered (connection refused/reset, timeout, 5xx)."""


class ControlPlaneRequestError(ControlPlaneError):
    """The control plane refused the request (4xx); ``field``/``stage`` name what is wrong."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None = None,
        stage: int | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.field = field
        self.stage = stage


class ControlPlaneAuthError(ControlPlaneRequestError):
    """401: missing or wrong bearer token."""


class InstanceUnknownError(ControlPlaneRequestError):
    """404 on an instance route: the control plane does not know the id (re-register)."""
