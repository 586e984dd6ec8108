"""A shed answer on the wire: a pod that refuses work it cannot serve in time answers 503 with
error type ``shed`` and a message that ends in ``; retry after X s``. The admission queue
writes it (:class:`Shed`); a sender's hop client reads it back (:func:`shed_retry_after`) and
tries another replica instead of ejecting this one."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

ShedReason = Literal["queue_full", "evicted", "deadline", "wait_limit"]
SHED_REASONS: tuple[ShedReason, ...] = ("queue_full", "evicted", "deadline", "wait_limit")
#: The error ``type`` of a shed answer (503): the sender tells it from a replica failure.
SHED_TYPE = "shed"
#: The header naming a shed answer's reason (its ``ShedReason``).
SHED_HEADER = "X-Omni-Shed"
_SHED_RETRY = re.compile(r"; retry after ([0-9]+(?:\.[0-9]+)?) s$")


@dataclass(frozen=True)
class Shed:
    """Why a request was refused, and when to come back."""

    reason: ShedReason
    retry_after_s: float
    detail: str

    def message(self) -> str:
        """The error message of the 503; :func:`shed_retry_after` reads it back."""
        return f"shed ({self.reason}): {self.detail}; retry after {self.retry_after_s:.3f} s"

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` in whole seconds (at least 1)."""
        return str(max(1, math.ceil(self.retry_after_s)))


def shed_retry_after(message: str) -> float | None:
    """The Retry-After of a shed answer's message; None when the message is not a shed's."""
    return retry_after_in(message) if message.startswith("shed (") else None


def retry_after_in(message: str) -> float | None:
    """The Retry-After a shed error's message carries (``…; retry after X s``), whether the
    stage that shed it answered this pod or a stage further on did; None without one."""
    found = _SHED_RETRY.search(message)
    return float(found.group(1)) if found else None
