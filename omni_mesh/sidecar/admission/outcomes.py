"""Counting stage executions: every execution a pod runs is counted once in
``omni_stage_requests_total{route, outcome}``, whichever way it arrived (``hop`` from another
stage, ``run`` from a /v1/run client, ``api`` from a client request this pod's own engine
serves). Work aborted because the client went away or its deadline passed is ``cancelled``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType

from omni_mesh.observability.children import labelled
from omni_mesh.sidecar.errors import ApiError
from omni_mesh.sidecar.pod import Pod

CANCELLED = "cancelled"
#: Stage error codes of work cut short from outside (a disconnect's abort, the deadline).
_CANCELLED_CODES = frozenset({"aborted", "deadline"})


def outcome_of(code: str) -> str:
    """The ``outcome`` label of a stage error code (``aborted``/``deadline`` -> ``cancelled``)."""
    return CANCELLED if code in _CANCELLED_CODES else code


@dataclass
class Execution:
    """The outcome an execution ends with; set it before the block ends (default ``ok``)."""

    outcome: str = "ok"

    def failed(self, code: str) -> None:
        if self.outcome == "ok":
            self.outcome = outcome_of(code)


def counted(pod: Pod, route: str) -> Counting:
    """Count the execution in the block once: its outcome, ``cancelled`` when the block is
    cancelled or closed early (a client that went away), the error's type when it raises."""
    return Counting(pod, route)


class Counting:
    """The context manager of :func:`counted` (a class, not a ``@contextmanager`` generator:
    it runs on every hop)."""

    __slots__ = ("_execution", "_pod", "_route")

    def __init__(self, pod: Pod, route: str) -> None:
        self._pod = pod
        self._route = route
        self._execution = Execution()

    def __enter__(self) -> Execution:
        return self._execution

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        execution = self._execution
        if exc is None:
            pass
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            execution.outcome = CANCELLED
        elif isinstance(exc, ApiError):
            execution.failed(exc.type)
        elif isinstance(exc, Exception):
            execution.failed("engine_error")
        pod = self._pod
        labelled(
            pod.metrics.requests,
            pod.pipeline.name,
            str(pod.stage_id),
            self._route,
            execution.outcome,
        ).inc()
