"""Session affinity: the replica of a stage a session's hops go to (``StageInput.affinity``).

Rendezvous hashing: every replica of the pool gets a score ``hash(key, instance_id)`` and the
session's replica is the one with the highest score. Every sender (each API server, each stage's
sidecar) sees the same pools from the control plane, so they all pick the same replica for a
key without sharing a table; a replica that joins or leaves moves only the sessions that score
highest on it. Bounded load (consistent hashing with bounded loads, Mirrokni et al.): a hop goes
to the first replica in score order that has room, i.e. whose requests in flight (this sender's
or its own report) would stay within :data:`SLACK` times the pool's mean with this one counted,
and under its capacity. A session (or many sharing one key) cannot pile onto its replica while
the others idle: past 1.25x the mean its hops go to its next replica, and come back when there
is room again; so does every session of a full, ejected or departed replica.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class Scored(Protocol):
    @property
    def instance_id(self) -> str: ...


R = TypeVar("R", bound=Scored)


def score(key: str, instance_id: str) -> int:
    """The rendezvous score of ``instance_id`` for ``key`` (the same in every process)."""
    digest = hashlib.blake2b(f"{key}\0{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranked(key: str, replicas: Sequence[R]) -> list[R]:
    """``replicas`` in the order a session with ``key`` prefers them."""
    return sorted(replicas, key=lambda r: score(key, r.instance_id), reverse=True)


#: How far above the pool's mean load a session's replica may go before its hops move on.
SLACK = 1.25


def with_room(
    key: str,
    replicas: Sequence[R],
    in_flight: Callable[[R], int],
    capacity: Callable[[R], int],
) -> R | None:
    """The session's replica with room (module docstring), in its order of preference; None
    when every one is full."""
    counts = [in_flight(r) for r in replicas]
    bound = math.ceil(SLACK * (sum(counts) + 1) / max(1, len(replicas)))
    by_id = {id(r): n for r, n in zip(replicas, counts, strict=True)}
    for replica in ranked(key, replicas):
        n = by_id[id(replica)]
        if n + 1 <= bound and n < capacity(replica):
            return replica
    return None
