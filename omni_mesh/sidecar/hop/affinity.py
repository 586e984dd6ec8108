"""Session affinity: the replica of a stage a session's hops go to (``StageInput.affinity``).

Rendezvous hashing: every replica of the pool gets a score ``hash(key, instance_id)`` and the
session's replica is the one with the highest score. Every sender (each API server, each stage's
sidecar) sees the same pools from the control plane, so they all pick the same replica for a
key without sharing a table; a replica that joins or leaves moves only the sessions that score
highest on it. Bounded load: a hop goes to the first replica in score order that has room
(requests in flight, this sender's or its own report, below its capacity), so one busy session
cannot pile onto a full replica; a full, ejected or departed replica's sessions go to their
next replica, and come back when it has room again.
"""

from __future__ import annotations

import hashlib
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


def with_room(key: str, replicas: Sequence[R], load: Callable[[R], float]) -> R | None:
    """The session's replica with room (``load`` below 1: in flight under capacity), in its
    order of preference; None when every one is full."""
    for replica in ranked(key, replicas):
        if load(replica) < 1.0:
            return replica
    return None
