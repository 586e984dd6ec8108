"""The admission queue of a pod: who runs next when every slot is taken, and who is shed.

Pure logic, no IO and no clock of its own (every call takes ``now``, monotonic seconds), so it
is unit-tested on its own; :mod:`omni_mesh.sidecar.admission.admit` wraps it in asyncio.

- **Order**: strict priority across classes (high > normal > low); round-robin between
  tenants within a class (a deficit round-robin where every request costs one); FIFO within a
  tenant.
- **Bounds**: at most ``max_queue`` waiters; none waits longer than ``max_wait_s``. When the
  queue is full, an arrival of a higher class evicts the newest waiter of the lowest class
  below it (from the tenant with the longest backlog); otherwise the arrival is refused.
- **Shed early**: at arrival the wait is estimated from the waiters that will be served first
  and the pod's service rate (``slots`` / the EWMA of admitted work's duration); a request
  that cannot finish before its deadline (or would wait past ``max_wait_s``) is shed at once.
  A waiter is shed as soon as its deadline can no longer be met (:meth:`hopeless_at`).
- Before any admitted work has finished the service time is unknown and the estimate is
  optimistic (no shedding by estimate): the bounds and the per-waiter timer still hold.
- **Waits** (:meth:`AdmissionQueue.mean_wait_s`): the mean wait of the requests admitted
  since the last reading, at least the age of the oldest one still waiting (a queue whose
  head does not move admits nobody, and a mean over the admitted would say 0).
- **Slots held on average** (:meth:`AdmissionQueue.mean_in_use`): slot-seconds over an
  interval (:class:`~omni_mesh.observability.time_average.TimeAverage`), which a count read at
  one instant misses when each piece of work is short.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal

from omni_mesh.observability.time_average import TimeAverage, WindowMean
from omni_mesh.sidecar.hop.shed import Shed, ShedReason


class Priority(IntEnum):
    """Request classes; a lower value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


PRIORITY_NAMES: tuple[str, ...] = tuple(p.name.lower() for p in Priority)
#: The classes lowest first (iterating the enum itself is slow on the shed path).
_LOWEST_FIRST: tuple[Priority, ...] = tuple(reversed(Priority))


def parse_priority(value: str) -> Priority:
    """``high|normal|low`` (any case) → :class:`Priority`; ValueError naming the choices."""
    try:
        return Priority[value.strip().upper()]
    except KeyError:
        raise ValueError(f"{value!r} is not one of {', '.join(PRIORITY_NAMES)}") from None


@dataclass(eq=False)
class Waiter:
    """One request at the gate. ``deadline`` and ``arrived`` are monotonic seconds."""

    priority: Priority
    tenant: str
    deadline: float
    arrived: float
    state: Literal["queued", "admitted", "shed", "gone"] = "queued"
    shed: Shed | None = None
    admitted_at: float = 0.0

    @property
    def waited_s(self) -> float:
        return max(0.0, self.admitted_at - self.arrived)


#: A request is queued only when its estimated wait is within this share of
#: ``max_queue_wait_s``: the rest is headroom for the estimate's error, so that a queued request
#: is served rather than shed after waiting the whole limit (a late shed is the costly kind).
ADMIT_HEADROOM = 0.9


@dataclass
class ServiceTime:
    """EWMA of how long admitted work holds a slot; None until the first completion."""

    alpha: float = 0.2
    seconds: float | None = None

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 1e-6)
        prev = self.seconds
        self.seconds = seconds if prev is None else prev + self.alpha * (seconds - prev)


@dataclass
class _Class:
    """The waiters of one priority class: a FIFO per tenant, tenants in round-robin order."""

    tenants: OrderedDict[str, deque[Waiter]] = field(default_factory=OrderedDict)
    size: int = 0

    def push(self, w: Waiter) -> None:
        self.tenants.setdefault(w.tenant, deque()).append(w)
        self.size += 1

    def pop(self) -> Waiter:
        tenant, fifo = next(iter(self.tenants.items()))
        w = fifo.popleft()
        if fifo:
            self.tenants.move_to_end(tenant)  # its turn is over
        else:
            del self.tenants[tenant]
        self.size -= 1
        return w

    def remove(self, w: Waiter) -> bool:
        fifo = self.tenants.get(w.tenant)
        if fifo is None or w not in fifo:
            return False
        fifo.remove(w)
        if not fifo:
            del self.tenants[w.tenant]
        self.size -= 1
        return True

    def newest_of_longest(self) -> Waiter:
        fifo = max(self.tenants.values(), key=len)
        return fifo[-1]

    def ahead_of_newcomer(self, tenant: str) -> int:
        """Waiters served before a new arrival of ``tenant`` under round-robin: each tenant
        gets as many turns first as ``tenant`` has waiters ahead of it, plus one."""
        turns = len(self.tenants.get(tenant, ())) + 1
        return sum(min(len(fifo), turns) for fifo in self.tenants.values())


class AdmissionQueue:
    """``slots`` requests run at once; the rest wait here (see the module docstring)."""

    def __init__(
        self, slots: int, max_queue: int, max_wait_s: float, *, alpha: float = 0.2
    ) -> None:
        if slots < 1 or max_queue < 0 or max_wait_s <= 0:
            raise ValueError("slots >= 1, max_queue >= 0 and max_wait_s > 0 are required")
        self.slots = slots
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.in_use = 0
        self.service = ServiceTime(alpha)
        self.slot_time = TimeAverage()
        self.waited = WindowMean()  # seconds each admitted request waited
        self._classes = [_Class() for _ in Priority]

    # ---- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(c.size for c in self._classes)

    def queued(self, priority: Priority) -> int:
        return self._classes[priority].size

    def rate(self) -> float | None:
        """Completions per second with every slot busy; None before any was measured."""
        s = self.service.seconds
        return None if s is None else self.slots / s

    def estimate_wait_s(self, priority: Priority, tenant: str) -> float:
        """How long a request arriving now would wait for a slot (0 when one is free)."""
        if self.in_use < self.slots and not len(self):
            return 0.0
        rate = self.rate()
        if rate is None:
            return 0.0  # no measurement yet: optimistic
        ahead = sum(c.size for c in self._classes[:priority])  # the classes above it
        ahead += self._classes[priority].ahead_of_newcomer(tenant)
        return (ahead + 1) / rate  # its slot frees with the completion after theirs

    def retry_after_s(self) -> float:
        """When to come back: the time the whole queue takes to drain (1 s unmeasured)."""
        rate = self.rate()
        return 1.0 if rate is None else (len(self) + 1) / rate

    def mean_in_use(self, now: float) -> float:
        """Slots held on average since the previous call (:class:`TimeAverage`)."""
        return self.slot_time.take(now)

    def oldest_wait_s(self, now: float) -> float:
        """How long the longest-waiting request still queued has waited (0: none waits)."""
        heads = (fifo[0].arrived for c in self._classes for fifo in c.tenants.values() if fifo)
        return max((now - arrived for arrived in heads), default=0.0)

    def mean_wait_s(self, now: float) -> float:
        """The mean wait of the requests admitted since the previous call, at least the age of
        the oldest still waiting."""
        return max(self.waited.take(), self.oldest_wait_s(now))

    def hopeless_at(self, w: Waiter) -> float:
        """When a waiter still queued is shed: its deadline less one service time, or
        ``max_wait_s`` after it arrived, whichever comes first."""
        return min(w.deadline - (self.service.seconds or 0.0), w.arrived + self.max_wait_s)

    # ---- changing --------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """A slot is free and nobody waits: an arrival is admitted at once."""
        return self.in_use < self.slots and not len(self)

    def refusal(self, priority: Priority, tenant: str, deadline: float, now: float) -> Shed | None:
        """Why an arrival of this class and tenant would be shed now (None: it would be
        admitted or queued). Changes nothing: the API server asks it on a request's headers
        alone, before reading its body; :meth:`offer` asks it for every arrival."""
        if self.idle:
            return None
        wait_s = self.estimate_wait_s(priority, tenant)
        service_s = self.service.seconds or 0.0
        if now + wait_s + service_s > deadline:
            why = (
                f"the deadline ({max(0.0, deadline - now):.3f} s away) cannot be met: "
                f"about {wait_s:.3f} s in the queue ({len(self)} waiting) "
                f"plus {service_s:.3f} s of service"
            )
            return Shed("deadline", wait_s, why)
        if wait_s > self.max_wait_s * ADMIT_HEADROOM:
            why = (
                f"about {wait_s:.3f} s in the queue: past {ADMIT_HEADROOM:.0%} of "
                f"max_queue_wait_s ({self.max_wait_s:g})"
            )
            return Shed("wait_limit", wait_s, why)
        if len(self) >= self.max_queue and self._victim(priority) is None:
            why = f"the queue is full ({self.max_queue} waiting, none of a lower class)"
            return Shed("queue_full", self.retry_after_s(), why)
        return None

    def offer(self, w: Waiter, now: float) -> list[Waiter]:
        """Admit ``w`` at once, queue it, or shed it. Returns the waiters whose state changed:
        ``w`` when admitted or shed, and a waiter evicted to make room for it."""
        if self.idle:
            return [self._admit(w, now)]
        shed = self.refusal(w.priority, w.tenant, w.deadline, now)
        if shed is not None:
            w.state = "shed"
            w.shed = shed
            return [w]
        changed: list[Waiter] = []
        if len(self) >= self.max_queue:
            victim = self._victim(w.priority)
            assert victim is not None  # refusal() said there is one
            self._classes[victim.priority].remove(victim)
            why = f"evicted from a full queue by a {w.priority.name.lower()}-priority request"
            changed.append(self._shed(victim, "evicted", why, self.retry_after_s()))
        self._classes[w.priority].push(w)
        return changed

    def release(self, now: float, service_s: float | None) -> list[Waiter]:
        """A slot freed (``service_s``: how long the work held it; None when it ended without
        being served, e.g. cancelled at once). Returns the waiters admitted into free slots."""
        self.in_use -= 1
        self.slot_time.change(self.in_use, now)
        if service_s is not None:
            self.service.observe(service_s)
        admitted: list[Waiter] = []
        while self.in_use < self.slots and len(self):
            cls = next(c for c in self._classes if c.size)
            admitted.append(self._admit(cls.pop(), now))
        return admitted

    def cancel(self, w: Waiter) -> None:
        """A queued waiter went away (its client left): it leaves the queue."""
        if w.state == "queued" and self._classes[w.priority].remove(w):
            w.state = "gone"

    def expire(self, w: Waiter, now: float) -> Waiter:
        """Shed a waiter whose time ran out (:meth:`hopeless_at` passed)."""
        self._classes[w.priority].remove(w)
        if now >= w.arrived + self.max_wait_s:
            why = f"waited max_queue_wait_s ({self.max_wait_s:g} s) without a slot"
            return self._shed(w, "wait_limit", why, self.retry_after_s())
        why = "its deadline could no longer be met while it waited"
        return self._shed(w, "deadline", why, self.retry_after_s())

    # ---- helpers ---------------------------------------------------------------------------

    def _admit(self, w: Waiter, now: float) -> Waiter:
        self.in_use += 1
        self.slot_time.change(self.in_use, now)
        self.waited.add(max(0.0, now - w.arrived))
        w.state = "admitted"
        w.admitted_at = now
        return w

    @staticmethod
    def _shed(w: Waiter, reason: ShedReason, detail: str, retry_after_s: float) -> Waiter:
        w.state = "shed"
        w.shed = Shed(reason, retry_after_s, detail)
        return w

    def _victim(self, priority: Priority) -> Waiter | None:
        """The waiter evicted for an arrival of ``priority``: the newest of the longest
        backlog in the lowest class below it; None when no class is below it or all are empty."""
        for p in _LOWEST_FIRST:
            if p <= priority:
                return None
            if self._classes[p].size:
                return self._classes[p].newest_of_longest()
        return None
