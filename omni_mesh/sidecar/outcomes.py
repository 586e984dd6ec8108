"""Counting stage executions: every execution a pod runs is counted once in
``omni_stage_requests_total{route, outcome}``, whichever way it arrived (``hop`` from another
stage, ``run`` from a /v1/run client, ``api`` from a client request this pod's own engine
serves). Work aborted because the client went away or its deadline passed is ``cancelled``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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


@contextmanager
def counted(pod: Pod, route: str) -> Iterator[Execution]:
    """Count the execution in the block once: its outcome, ``cancelled`` when the block is
    cancelled or closed early (a client that went away), the error's type when it raises."""
    execution = Execution()
    try:
        yield execution
    except (asyncio.CancelledError, GeneratorExit):
        execution.outcome = CANCELLED
        raise
    except ApiError as exc:
        execution.failed(exc.type)
        raise
    except Exception:
        execution.failed("engine_error")
        raise
    finally:
        labelled(
            pod.metrics.requests, pod.pipeline.name, str(pod.stage_id), route, execution.outcome
        ).inc()
