"""One hop's replay budget (:class:`HopBudget`: the deadline, the retries, the attempt
numbers), what the hop cost (:class:`HopStats`), and the failure that ends it
(:class:`HopUnavailable`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal


class HopUnavailable(Exception):
    """No replica of the stage could take the hop before the deadline (→ 503), or the
    deadline had passed before the hop was even tried (``code="deadline"`` → 504)."""

    def __init__(
        self,
        stage_id: int,
        message: str,
        retry_after_s: float = 1.0,
        code: Literal["unavailable", "deadline", "shed"] = "unavailable",
    ) -> None:
        super().__init__(message)
        self.stage_id = stage_id
        self.retry_after_s = retry_after_s
        self.code = code


@dataclass
class HopStats:
    """What one hop cost; fed to metrics by the caller."""

    attempts: int = 0
    retries: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    replica: str = ""
    waited_full: int = 0
    shed: int = 0  # answers of replicas whose admission queue shed the hop
    tried: list[str] = field(default_factory=list)
    # A split stage's KV hand-offs: "remote" (prefilled on a prefill replica, the KV pulled by
    # the decode replica) or "local" (no prefill replica could: the decode replica prefilled).
    kv_handoffs: list[str] = field(default_factory=list)
    # Session affinity (``StageInput.affinity``): "home" (its replica took it) or "moved" (its
    # replica was full, ejected or gone: the next with room did), per replica picked.
    affinity: list[str] = field(default_factory=list)

    def add_tries(self, other: HopStats) -> None:
        """Count the tries of a call made on a budget of its own (a split stage's prefill)."""
        self.attempts += other.attempts
        self.bytes_sent += other.bytes_sent
        self.tried += other.tried


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class HopBudget:
    """One hop's replay budget: the request's deadline, the retries left and the attempt
    numbers. Every replica failure of the hop, inside ``HopClient.call`` or mid-stream,
    spends from this one object."""

    stage_id: int
    deadline_ms: int
    retries: int  # replays allowed after the first failure
    first_attempt: int = 0  # the attempt number of the hop's first try (``si.attempt``)
    stats: HopStats = field(default_factory=HopStats)
    failures: int = 0

    @property
    def attempt(self) -> int:
        """The attempt number of the next try (one more per failed replica)."""
        return self.first_attempt + self.failures

    def remaining_s(self) -> float:
        """Seconds left before the deadline; :class:`HopUnavailable` when none are."""
        remaining_s = (self.deadline_ms - now_ms()) / 1000.0
        if remaining_s > 0:
            return remaining_s
        tried = self.stats.tried
        if not (tried or self.stats.waited_full):
            raise HopUnavailable(
                self.stage_id,
                f"the request's deadline passed before its hand-off to stage {self.stage_id}",
                code="deadline",
            )
        raise HopUnavailable(
            self.stage_id,
            f"no replica of stage {self.stage_id} answered before the request's deadline "
            f"(tried {len(tried)}: {', '.join(tried) or 'pool empty'})",
        )

    def spend(self, spent: str) -> None:
        """Count one failed replica; :class:`HopUnavailable` (``spent``, then the budget)
        when that was the last retry."""
        self.failures += 1
        if self.failures > self.retries:
            raise HopUnavailable(self.stage_id, f"{spent}; retry budget ({self.retries}) spent")
        self.stats.retries += 1
