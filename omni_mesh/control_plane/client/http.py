"""``ControlPlaneClient``: the typed async HTTP client of the control plane API.

Several omni-cp URLs may be given (they share one Redis): a request goes to the URL that last
answered and moves on to the next on a connection error, a timeout or a 5xx. 4xx answers raise
:class:`ControlPlaneRequestError` (``InstanceUnknownError`` for 404 on an instance route,
``ControlPlaneAuthError`` for 401) with the field the server named.
"""

from __future__ import annotations

import errno
import io
import logging
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.errors import (
    ControlPlaneAuthError,
    ControlPlaneError,
    ControlPlaneRequestError,
    ControlPlaneUnavailableError,
    EndpointFailure,
    InstanceUnknownError,
)
from omni_mesh.control_plane.schema import (
    DrainRequest,
    ErrorBody,
    HealthStatus,
    HeartbeatAck,
    HeartbeatRequest,
    InstanceInfo,
    IsolateRequest,
    LoadReport,
    PipelineList,
    PipelineSnapshot,
    PoolSnapshot,
    RegisterRequest,
    Registration,
    ScalePolicyRequest,
    ScalePool,
    ScaleStatus,
    SuspectRequest,
    SuspectResult,
    WakeRequest,
    clean_reason,
)

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_RETRY_SAME_URL = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_STREAM_BODY_BYTES = 512 * 1024


class ControlPlaneClient:
    """Async client of one control plane (one or more omni-cp URLs). Close it when done."""

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        auth_token: str | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        self.urls: tuple[str, ...] = tuple(u.rstrip("/") for u in url_list if u.strip())
        if not self.urls:
            raise ValueError("ControlPlaneClient needs at least one URL")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._preferred = 0
        self._session: aiohttp.ClientSession | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> ControlPlaneClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ---- API -----------------------------------------------------------------------------

    async def register(self, request: RegisterRequest) -> Registration:
        body = await self._call("POST", "/v1/instances", body=request)
        return _parse(Registration, body)

    async def heartbeat(self, instance_id: str, load: LoadReport) -> HeartbeatAck:
        """Renew the lease; raises :class:`InstanceUnknownError` when the id is unknown."""
        path = f"/v1/instances/{instance_id}/heartbeat"
        body = await self._call("PUT", path, body=HeartbeatRequest(load=load), instance=True)
        return _parse(HeartbeatAck, body)

    async def deregister(self, instance_id: str) -> None:
        await self._call("DELETE", f"/v1/instances/{instance_id}", instance=True)

    async def isolate(self, instance_id: str, reason: str | None = None) -> InstanceInfo:
        req = IsolateRequest() if reason is None else IsolateRequest(reason=reason)
        path = f"/v1/instances/{instance_id}/isolate"
        return _parse(InstanceInfo, await self._call("POST", path, body=req, instance=True))

    async def drain(self, instance_id: str, reason: str | None = None) -> InstanceInfo:
        req = DrainRequest() if reason is None else DrainRequest(reason=reason)
        path = f"/v1/instances/{instance_id}/drain"
        return _parse(InstanceInfo, await self._call("POST", path, body=req, instance=True))

    async def readmit(self, instance_id: str) -> InstanceInfo:
        path = f"/v1/instances/{instance_id}/readmit"
        return _parse(InstanceInfo, await self._call("POST", path, instance=True))

    async def promote(self, instance_id: str) -> InstanceInfo:
        """Put a warm standby into its pool now (unchanged in any other state)."""
        path = f"/v1/instances/{instance_id}/promote"
        return _parse(InstanceInfo, await self._call("POST", path, instance=True))

    async def suspect(
        self, instance_id: str, reason: str, *, reporter: str | None = None
    ) -> SuspectResult:
        """Report that a connection to the instance failed. The control plane probes it and
        isolates it (reason ``unreachable``) only if its own probe fails too. ``reason`` may be
        any text (an exception's): it is flattened and truncated to what the API accepts."""
        req = SuspectRequest(
            reason=clean_reason(reason),
            reporter=None if reporter is None else clean_reason(reporter, 256),
        )
        path = f"/v1/instances/{instance_id}/suspect"
        return _parse(SuspectResult, await self._call("POST", path, body=req, instance=True))

    async def instances(self, pipeline: str, stage_id: int, all: bool = False) -> PoolSnapshot:
        """Healthy instances of one stage pool (``all=True``: any state)."""
        path = f"/v1/pipelines/{pipeline}/stages/{stage_id}/instances"
        body = await self._call("GET", path, params={"all": "1" if all else "0"})
        return _parse(PoolSnapshot, body)

    async def pipelines(self) -> PipelineList:
        return _parse(PipelineList, await self._call("GET", "/v1/pipelines"))

    async def watch(
        self, pipeline: str, since: int | None = None, timeout_s: float = 30.0
    ) -> PipelineSnapshot:
        """Long-poll: the snapshot after version ``since`` (at once if it is not current)."""
        params = {"pipeline": pipeline, "timeout_s": f"{timeout_s:g}"}
        if since is not None:
            params["since"] = str(since)
        body = await self._call(
            "GET", "/v1/watch", params=params, timeout_s=timeout_s + self.timeout_s
        )
        return _parse(PipelineSnapshot, body)

    async def health(self) -> HealthStatus:
        return _parse(HealthStatus, await self._call("GET", "/healthz"))

    # ---- autoscaling (the launcher's actuator) ---------------------------------------------

    async def scale(
        self, pipeline: str, stage_id: int, *, pool: ScalePool = ScalePool.STAGE
    ) -> ScaleStatus:
        """The pool's scale resource (the stage's own, or ``pool=PREFILL``: a split stage's
        prefill pool): policy (None: not autoscaled), desired and ready replicas, and the last
        decision with its inputs and reason."""
        path = f"/v1/pipelines/{pipeline}/stages/{stage_id}/scale"
        return _parse(ScaleStatus, await self._call("GET", path, params=_pool_params(pool)))

    async def set_scale_policy(
        self,
        pipeline: str,
        stage_id: int,
        policy: AutoscaleConfig,
        *,
        replicas: int | None = None,
        pool: ScalePool = ScalePool.STAGE,
    ) -> ScaleStatus:
        """Set (idempotently) the pool's autoscale policy; ``replicas`` is the starting desired
        count if the pool has no decision yet (default: its ready count)."""
        path = f"/v1/pipelines/{pipeline}/stages/{stage_id}/scale"
        req = ScalePolicyRequest(autoscale=policy, replicas=replicas)
        body = await self._call("PUT", path, body=req, params=_pool_params(pool))
        return _parse(ScaleStatus, body)

    async def remove_scale_policy(
        self, pipeline: str, stage_id: int, *, pool: ScalePool = ScalePool.STAGE
    ) -> None:
        """Stop autoscaling the pool (its policy and decision are forgotten)."""
        path = f"/v1/pipelines/{pipeline}/stages/{stage_id}/scale"
        await self._call("DELETE", path, params=_pool_params(pool))

    async def wake_stage(
        self, pipeline: str, stage_id: int, waiting: int = 1, *, pool: ScalePool = ScalePool.STAGE
    ) -> ScaleStatus:
        """Tell the policy that ``waiting`` requests wait for a pool with no ready replica."""
        path = f"/v1/pipelines/{pipeline}/stages/{stage_id}/scale/wake"
        req = WakeRequest(waiting=waiting)
        body = await self._call("POST", path, body=req, params=_pool_params(pool))
        return _parse(ScaleStatus, body)

    # ---- transport -----------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        params: Mapping[str, str] | None = None,
    ) -> bytes:
        """One call with this client's failover, for the typed clients of other resources
        (``SessionsClient``): the answer's body, or the errors the methods above raise."""
        return await self._call(method, path, body=body, params=params)

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        instance: bool = False,
    ) -> bytes:
        data = None if body is None else body.model_dump_json(exclude_none=True).encode()
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        failures: list[EndpointFailure] = []
        n = len(self.urls)
        for offset in range(n):
            index = (self._preferred + offset) % n
            url = self.urls[index] + path
            for attempt in range(2):
                try:
                    status, payload = await self._send(method, url, data, params, timeout)
                except _RETRY_SAME_URL as exc:
                    if attempt == 0:  # a stale keep-alive connection: retry once on this URL
                        continue
                    failures.append(
                        EndpointFailure(self.urls[index], describe_transport_error(exc))
                    )
                except (aiohttp.ClientError, TimeoutError) as exc:
                    problem = describe_transport_error(exc, timeout.total)
                    failures.append(EndpointFailure(self.urls[index], problem))
                else:
                    if status < 500:
                        self._preferred = index
                        return _check(status, payload, instance=instance)
                    failures.append(EndpointFailure(self.urls[index], _message(payload), status))
                break
        summary = "; ".join(
            f"{f.url}: {f.problem}" if f.status is None else f"{f.url}: HTTP {f.status} {f.problem}"
            for f in failures
        )
        raise ControlPlaneUnavailableError(
            f"{method} {path}: no control plane answered ({summary})", tuple(failures)
        )

    async def _send(
        self,
        method: str,
        url: str,
        data: bytes | None,
        params: Mapping[str, str] | None,
        client_timeout: aiohttp.ClientTimeout,
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if data is not None else None
        # A large body (a session's items) goes as a stream: raw bytes that big would make
        # aiohttp warn that they block the event loop.
        payload = io.BytesIO(data) if data is not None and len(data) > _STREAM_BODY_BYTES else data
        async with self._get_session().request(
            method, url, data=payload, params=params, headers=headers, timeout=client_timeout
        ) as response:
            return response.status, await response.read()


_ERRNO_TEXT = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset",
    errno.ETIMEDOUT: "connection timed out",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.EPIPE: "connection closed",
}


def _os_error_text(error: OSError | None) -> str | None:
    if error is None:
        return None
    if error.errno in _ERRNO_TEXT:
        return _ERRNO_TEXT[error.errno]
    if error.strerror:
        return str(error.strerror)
    if error.errno is not None and error.errno > 0:
        return os.strerror(error.errno)
    return str(error) or None


def describe_transport_error(exc: BaseException, timeout_s: float | None = None) -> str:
    """A short, human phrase for why a request got no answer: "connection refused",
    "no answer within 2s", "cannot resolve host cp.example" - never a repr of aiohttp's
    internals (a ``ConnectionKey``)."""
    if isinstance(exc, TimeoutError):
        return "no answer in time" if timeout_s is None else f"no answer within {timeout_s:g}s"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve host {exc.host} ({_os_error_text(exc.os_error) or 'DNS error'})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return _os_error_text(exc.os_error) or f"cannot connect to {exc.host}:{exc.port}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without answering"
    if isinstance(exc, aiohttp.InvalidURL):
        return f"invalid URL {str(exc.url)!r}"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer was cut short"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"bad answer: HTTP {exc.status} {exc.message}".strip()
    if isinstance(exc, OSError):
        text = _os_error_text(exc)
        if text:
            return text
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _message(payload: bytes) -> str:
    try:
        return ErrorBody.model_validate_json(payload).error.message
    except ValidationError:
        return payload[:200].decode(errors="replace")


def _check(status: int, payload: bytes, *, instance: bool) -> bytes:
    if status < 400:
        return payload
    try:
        err = ErrorBody.model_validate_json(payload).error
        message, field, stage = err.message, err.param, None
        code = err.code if isinstance(err.code, str) else None
    except ValidationError:
        message, field, stage, code = payload[:200].decode(errors="replace"), None, None, None
    if status == 401:
        raise ControlPlaneAuthError(status, message, field=field)
    if status == 404 and instance:
        raise InstanceUnknownError(status, message, field=field)
    raise ControlPlaneRequestError(status, message, field=field, stage=stage, code=code)


def _parse(model: type[M], payload: bytes) -> M:
    try:
        return model.model_validate_json(payload)
    except ValidationError as exc:
        raise ControlPlaneError(f"unexpected answer from the control plane: {exc}") from exc


def _pool_params(pool: ScalePool) -> dict[str, str] | None:
    """The scale routes' query: none for the stage's own pool (what every omni-cp knows)."""
    return None if pool is ScalePool.STAGE else {"pool": pool.value}
