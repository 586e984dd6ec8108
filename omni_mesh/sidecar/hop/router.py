"""Replica choice: power of two choices on in-flight load, same-host preference on ``shm``
edges, and immediate ejection of a replica whose connection failed.

The router reads pools from the control plane's watch cache (which keeps serving the last known
pools while the control plane is unreachable — invariant 5) and keeps its own view of what it
has in flight to each replica, which is fresher than any heartbeat. A split stage's prefill
pool is weighed by prompt tokens instead: the prompt tokens of this sender's prefills not
answered yet, or the replica's reported queue of prefill tokens when higher (it counts the
other senders' too); requests in flight break a tie. An ``on_eject`` callback
hears of each ejection (the sidecar reports connection-level ones to the control plane, which
probes the replica and takes it out of every router's pools if it is dead).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from omni_mesh.sidecar.hop.affinity import ranked, with_room

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replica:
    instance_id: str
    stage_id: int
    address: str
    host_id: str
    capacity: int
    reported_in_flight: int = 0
    kv_role: str = ""  # a split stage's pool: "prefill" or "decode" ("" = unsplit)
    # A prefill replica's prompt tokens not prefilled yet, as its last heartbeat said.
    reported_prefill_tokens: int = 0


class PoolView(Protocol):
    """What the router needs of the discovery cache."""

    def replicas(self, stage_id: int) -> Iterable[Replica]: ...


#: ``on_eject(instance_id, reason, connection_level)``.
OnEject = Callable[[str, str, bool], None]


class Router:
    """Picks a replica of a stage for a hop."""

    def __init__(
        self,
        pools: PoolView,
        *,
        host_id: str,
        eject_s: float = 5.0,
        rng: random.Random | None = None,
        on_eject: OnEject | None = None,
    ) -> None:
        self.pools = pools
        self.host_id = host_id
        self.eject_s = eject_s
        self.on_eject = on_eject
        self._rng = rng or random.Random()
        self._in_flight: dict[str, int] = {}
        self._prefill_tokens: dict[str, int] = {}  # prompt tokens of prefills not answered
        self._ejected: dict[str, float] = {}
        self._reported: set[str] = set()  # ejected for a connection-level failure, told so

    def candidates(
        self, stage_id: int, exclude: set[str], *, prefill: bool = False
    ) -> list[Replica]:
        """The replicas a hop may go to: a split stage's prefill pool when ``prefill``, else
        every other replica (a prefill replica takes only prefill requests)."""
        now = time.monotonic()
        out = []
        for r in self.pools.replicas(stage_id):
            if r.instance_id in exclude or (r.kv_role == "prefill") != prefill:
                continue
            until = self._ejected.get(r.instance_id)
            if until is not None:
                if until > now:
                    continue
                del self._ejected[r.instance_id]
                self._reported.discard(r.instance_id)
            out.append(r)
        return out

    def pick(
        self,
        stage_id: int,
        *,
        exclude: set[str],
        prefer_same_host: bool,
        prefill: bool = False,
        affinity: str = "",
    ) -> Replica | None:
        """The less loaded of two candidates drawn at random: by requests in flight per unit
        of capacity, or (``prefill``: a split stage's prefill pool) by prompt tokens queued.
        With ``affinity`` (a session's key) the session's replica while it has room, else
        its next one with room (``affinity.py``); the two random ones when all are full."""
        pool = self._pool(stage_id, exclude, prefer_same_host, prefill)
        if not pool:
            return None
        if affinity and not prefill:
            chosen = with_room(affinity, pool, self._in_flight_at, lambda r: max(1, r.capacity))
            if chosen is not None:
                return chosen
        if len(pool) == 1:
            return pool[0]
        a, b = self._rng.sample(pool, 2)
        if prefill:
            return a if self._prefill_load(a) <= self._prefill_load(b) else b
        return a if self._load(a) <= self._load(b) else b

    def home(self, stage_id: int, affinity: str, *, prefer_same_host: bool) -> str:
        """The instance id of the session's own replica (its first by score, room or not,
        ejected ones left out); "" when the pool is empty."""
        pool = self._pool(stage_id, set(), prefer_same_host, False)
        return ranked(affinity, pool)[0].instance_id if pool else ""

    def _pool(
        self, stage_id: int, exclude: set[str], prefer_same_host: bool, prefill: bool
    ) -> list[Replica]:
        pool = self.candidates(stage_id, exclude, prefill=prefill)
        if prefer_same_host:
            local = [r for r in pool if r.host_id == self.host_id]
            pool = local or pool
        return pool

    def is_split(self, stage_id: int) -> bool:
        """Whether ``stage_id``'s pools are split into prefill and decode (its replicas say
        so when they register): a hop there goes to a prefill replica first."""
        return any(r.kv_role for r in self.pools.replicas(stage_id))

    def _in_flight_at(self, r: Replica) -> int:
        """Requests in flight at ``r``: ours (exact, fresh) or its report (every sender's)."""
        return max(self._in_flight.get(r.instance_id, 0), r.reported_in_flight)

    def _load(self, r: Replica) -> float:
        # What we have in flight there is exact and fresh; what it reported (at most one
        # heartbeat old) also counts other routers' traffic. Its load is at least either.
        mine = self._in_flight.get(r.instance_id, 0)
        return max(mine, r.reported_in_flight) / max(1, r.capacity)

    def _prefill_load(self, r: Replica) -> tuple[int, float]:
        # The prompt tokens queued there: ours (exact and fresh) or its report (a heartbeat
        # old, every sender's), whichever is higher, as for requests; then requests in flight.
        mine = self._prefill_tokens.get(r.instance_id, 0)
        return max(mine, r.reported_prefill_tokens), self._load(r)

    def begin(self, instance_id: str, *, prefill_tokens: int = 0) -> None:
        """A request goes to ``instance_id`` (a prefill of ``prefill_tokens`` prompt tokens)."""
        _add(self._in_flight, instance_id, 1)
        if prefill_tokens > 0:
            _add(self._prefill_tokens, instance_id, prefill_tokens)

    def end(self, instance_id: str, *, prefill_tokens: int = 0) -> None:
        """The request :meth:`begin` counted was answered, failed or given up (the same
        ``prefill_tokens``)."""
        _add(self._in_flight, instance_id, -1)
        if prefill_tokens > 0:
            _add(self._prefill_tokens, instance_id, -prefill_tokens)

    def eject(self, instance_id: str, reason: str, *, connection_level: bool = False) -> None:
        """Take a replica out of this router's pools at once (a failed connection says more,
        sooner, than a missed lease); it comes back after ``eject_s`` if still discovered.

        ``on_eject`` is called when the replica becomes newly ejected, and once more if the
        ejection began for another failure (a 503, a timeout) and a connection-level one
        follows: at most one connection-level call per ejection."""
        now = time.monotonic()
        newly = self._ejected.get(instance_id, 0.0) <= now
        if newly:  # log once per ejection, not per caller
            self._reported.discard(instance_id)
            logger.warning("ejecting instance=%s for %.1fs: %s", instance_id, self.eject_s, reason)
        self._ejected[instance_id] = now + self.eject_s
        notify = newly or (connection_level and instance_id not in self._reported)
        if connection_level:
            self._reported.add(instance_id)
        if notify and self.on_eject is not None:
            try:
                self.on_eject(instance_id, reason, connection_level)
            except Exception:  # a reporting bug must not break routing
                logger.exception("on_eject callback failed for instance=%s", instance_id)

    def in_flight(self, instance_id: str) -> int:
        return self._in_flight.get(instance_id, 0)

    def prefill_tokens(self, instance_id: str) -> int:
        """The prompt tokens of this router's prefills on ``instance_id`` not answered yet."""
        return self._prefill_tokens.get(instance_id, 0)


def _add(counts: dict[str, int], key: str, n: int) -> None:
    """Add ``n`` to ``counts[key]``, never below zero (a count at zero is dropped)."""
    total = counts.get(key, 0) + n
    if total > 0:
        counts[key] = total
    else:
        counts.pop(key, None)
