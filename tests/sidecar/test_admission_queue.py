"""The admission queue's logic, without IO: order (priority, tenant round-robin, FIFO), bounds,
eviction of low priority, the wait estimate and the shed decisions, the mean wait it reports."""

from __future__ import annotations

import math

import pytest

from omni_mesh.sidecar.admission.queue import AdmissionQueue, Priority, Waiter, parse_priority
from omni_mesh.sidecar.hop.shed import Shed, shed_retry_after

HIGH, NORMAL, LOW = Priority.HIGH, Priority.NORMAL, Priority.LOW
FAR = 1e9  # a deadline that never matters


def waiter(
    priority: Priority = NORMAL, tenant: str = "", deadline: float = FAR, at: float = 0.0
) -> Waiter:
    return Waiter(priority, tenant, deadline, at)


def full_queue(slots: int = 1, max_queue: int = 100, max_wait_s: float = 60.0) -> AdmissionQueue:
    """A queue whose slots are all taken."""
    q = AdmissionQueue(slots, max_queue, max_wait_s)
    for _ in range(slots):
        assert q.offer(waiter(), 0.0)[0].state == "admitted"
    return q


def drain(q: AdmissionQueue) -> list[Waiter]:
    """Release slots one at a time until the queue is empty; the admission order."""
    order: list[Waiter] = []
    while len(q):
        order += q.release(1.0, None)
    return order


def test_free_slots_admit_at_once_and_releases_admit_the_next() -> None:
    q = AdmissionQueue(2, 10, 60.0)
    a, b, c = waiter(), waiter(), waiter()
    assert q.offer(a, 0.0) == [a] and a.state == "admitted"
    assert q.offer(b, 0.0) == [b] and q.in_use == 2
    assert q.offer(c, 0.0) == [] and c.state == "queued" and len(q) == 1
    assert q.release(0.5, 0.5) == [c] and c.state == "admitted" and c.waited_s == 0.5
    assert q.in_use == 2 and len(q) == 0
    assert q.release(0.6, 0.1) == [] and q.in_use == 1


def test_fifo_within_a_tenant() -> None:
    q = full_queue()
    ws = [waiter(tenant="a") for _ in range(5)]
    for w in ws:
        q.offer(w, 0.0)
    assert drain(q) == ws


def test_strict_priority_across_classes() -> None:
    q = full_queue()
    low, normal, high = waiter(LOW), waiter(NORMAL), waiter(HIGH)
    for w in (low, normal, high):
        q.offer(w, 0.0)
    assert drain(q) == [high, normal, low]


def test_round_robin_between_tenants_of_one_class() -> None:
    q = full_queue()
    burst = [waiter(tenant="a") for _ in range(4)]
    others = [waiter(tenant="b"), waiter(tenant="c")]
    for w in [*burst, *others]:
        q.offer(w, 0.0)
    order = drain(q)
    assert order[:3] == [burst[0], others[0], others[1]]  # b and c do not wait for a's burst
    assert order[3:] == burst[1:]


def test_a_full_queue_refuses_an_arrival_of_the_lowest_class() -> None:
    q = full_queue(max_queue=2)
    q.offer(waiter(LOW), 0.0)
    q.offer(waiter(NORMAL), 0.0)
    late = waiter(LOW)
    assert q.offer(late, 0.0) == [late]
    assert late.state == "shed" and late.shed is not None and late.shed.reason == "queue_full"
    assert len(q) == 2


def test_a_full_queue_evicts_low_priority_for_a_higher_arrival() -> None:
    q = full_queue(max_queue=3)
    lows_a = [waiter(LOW, "a"), waiter(LOW, "a")]
    low_b = waiter(LOW, "b")
    for w in [*lows_a, low_b]:
        q.offer(w, 0.0)
    high = waiter(HIGH)
    changed = q.offer(high, 0.0)
    victim = lows_a[1]  # the newest of the longest backlog in the lowest class
    assert changed == [victim] and victim.state == "shed"
    assert victim.shed is not None and victim.shed.reason == "evicted"
    assert high.state == "queued" and len(q) == 3
    assert drain(q) == [high, lows_a[0], low_b]


def test_an_equal_class_does_not_evict() -> None:
    q = full_queue(max_queue=1)
    q.offer(waiter(NORMAL), 0.0)
    arrival = waiter(NORMAL)
    q.offer(arrival, 0.0)
    assert arrival.shed is not None and arrival.shed.reason == "queue_full"


def test_max_queue_zero_sheds_whenever_the_slots_are_full() -> None:
    q = full_queue(max_queue=0)
    w = waiter(HIGH)
    q.offer(w, 0.0)
    assert w.shed is not None and w.shed.reason == "queue_full"


def test_the_wait_estimate_follows_the_measured_service_time() -> None:
    q = full_queue(slots=4)
    assert q.estimate_wait_s(NORMAL, "") == 0.0  # nothing measured yet: optimistic
    for _ in range(4):
        q.release(0.0, 0.1)
        q.offer(waiter(), 0.0)
    assert q.rate() == pytest.approx(40.0)  # 4 slots / 0.1 s
    for _ in range(7):
        q.offer(waiter(tenant="t"), 0.0)
    assert q.estimate_wait_s(NORMAL, "t") == pytest.approx(8 / 40)  # 7 ahead + its own turn
    assert q.estimate_wait_s(HIGH, "t") == pytest.approx(1 / 40)  # nothing of a higher class
    # A new tenant's first request is served in the first round: one turn of t's ahead of it.
    assert q.estimate_wait_s(NORMAL, "new") == pytest.approx(2 / 40)
    assert q.retry_after_s() == pytest.approx(8 / 40)


def test_a_deadline_that_cannot_be_met_is_shed_at_arrival() -> None:
    q = full_queue(slots=1)
    q.release(0.0, 0.5)  # service time 0.5 s → 2 per second
    q.offer(waiter(), 0.0)
    for _ in range(3):
        q.offer(waiter(), 0.0)
    hopeless = waiter(deadline=1.0)  # 4 turns ahead = 2 s, plus 0.5 s of service
    assert q.offer(hopeless, 0.0) == [hopeless]
    assert hopeless.shed is not None and hopeless.shed.reason == "deadline"
    assert hopeless.shed.retry_after_s == pytest.approx(2.0)
    fine = waiter(deadline=10.0)
    assert q.offer(fine, 0.0) == [] and fine.state == "queued"
    urgent = waiter(HIGH, deadline=1.2)  # ahead of every normal one: 0.5 + 0.5 s
    assert q.offer(urgent, 0.0) == [] and urgent.state == "queued"


def test_a_wait_past_max_queue_wait_is_shed_at_arrival() -> None:
    q = full_queue(slots=1, max_wait_s=1.2)
    q.release(0.0, 0.5)
    q.offer(waiter(), 0.0)  # admitted
    q.offer(waiter(), 0.0)
    within = waiter()
    q.offer(within, 0.0)  # 1 ahead: 2 completions = 1.0 s, within 90% of the limit
    assert within.state == "queued"
    w = waiter()
    q.offer(w, 0.0)  # 2 ahead: 1.5 s
    assert w.shed is not None and w.shed.reason == "wait_limit"


def test_a_wait_in_the_last_tenth_of_max_queue_wait_is_shed_at_arrival() -> None:
    """The estimate keeps 10% headroom: a request it would queue for 1.0 s of a 1.05 s limit
    is refused at once rather than shed after waiting the whole limit."""
    q = full_queue(slots=1, max_wait_s=1.05)
    q.release(0.0, 0.5)
    q.offer(waiter(), 0.0)  # admitted
    q.offer(waiter(), 0.0)  # 0.5 s: queued
    w = waiter()
    q.offer(w, 0.0)  # 1 ahead: 1.0 s, under the limit but past 90% of it
    assert w.shed is not None and w.shed.reason == "wait_limit"
    assert "90% of max_queue_wait_s" in w.shed.message()


def test_refusal_says_what_offer_would_do_and_changes_nothing() -> None:
    """The header-time check: the same verdict as an arrival's, the queue untouched."""
    q = AdmissionQueue(1, 2, 10.0)
    assert q.idle and q.refusal(LOW, "", FAR, 0.0) is None
    q.offer(waiter(), 0.0)  # admitted
    q.release(0.0, 0.5)  # service time 0.5 s → 2 per second
    q.offer(waiter(), 0.0)  # admitted
    q.offer(waiter(), 0.0)
    q.offer(waiter(LOW), 0.0)  # full: one normal and one low wait
    assert len(q) == 2 and not q.idle
    before = (len(q), q.in_use, q.queued(NORMAL), q.queued(LOW))
    full = q.refusal(LOW, "", FAR, 0.0)
    assert full is not None and full.reason == "queue_full"
    assert q.refusal(NORMAL, "", FAR, 0.0) is None  # it would evict the low one
    late = q.refusal(NORMAL, "", 0.6, 0.0)  # 1 s of queue and 0.5 s of service
    assert late is not None and late.reason == "deadline"
    assert (len(q), q.in_use, q.queued(NORMAL), q.queued(LOW)) == before
    for priority, deadline in ((LOW, FAR), (NORMAL, FAR), (NORMAL, 0.6)):
        verdict = q.refusal(priority, "", deadline, 0.0)
        w = waiter(priority, deadline=deadline)
        changed = q.offer(w, 0.0)
        assert (w.shed.reason if w.shed else None) == (verdict.reason if verdict else None)
        assert (w in changed) == (verdict is not None)


def test_hopeless_at_and_expire() -> None:
    q = full_queue(slots=1, max_wait_s=5.0)
    q.release(0.0, 0.5)
    q.offer(waiter(), 0.0)
    w = waiter(deadline=3.0, at=1.0)
    q.offer(w, 1.0)
    assert q.hopeless_at(w) == pytest.approx(2.5)  # deadline less one service time
    patient = waiter(at=1.0)
    q.offer(patient, 1.0)
    assert q.hopeless_at(patient) == pytest.approx(6.0)  # max_wait_s after it arrived
    shed = q.expire(w, 2.5).shed
    assert shed is not None and shed.reason == "deadline"
    assert shed.retry_after_s == pytest.approx(1.0)  # the queue left (1) drains in 2 turns
    shed = q.expire(patient, 6.0).shed
    assert shed is not None and shed.reason == "wait_limit"
    assert len(q) == 0


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    q = full_queue()
    a, b = waiter(), waiter()
    q.offer(a, 0.0)
    q.offer(b, 0.0)
    q.cancel(a)
    assert a.state == "gone" and len(q) == 1
    assert drain(q) == [b]


def test_mean_in_use_counts_short_work_that_an_instant_misses() -> None:
    """Slot-seconds over each interval between two reads: work that held a slot for part of
    it counts for that part, though no slot is held when it is read."""
    q = AdmissionQueue(4, 10, 60.0)
    q.offer(waiter(), 10.0)  # the first interval starts with the first admission
    q.release(10.1, 0.1)
    q.offer(waiter(), 10.5)
    q.release(10.8, 0.3)
    assert q.in_use == 0
    assert q.mean_in_use(11.0) == pytest.approx((0.1 + 0.3) / 1.0)
    q.offer(waiter(), 11.0)
    q.offer(waiter(), 11.5)  # two held for the second half
    assert q.mean_in_use(12.0) == pytest.approx((0.5 + 2 * 0.5) / 1.0)
    assert q.mean_in_use(12.0) == 2.0  # no time passed: what is held now
    assert q.mean_in_use(14.0) == pytest.approx(2.0)
    q.release(14.0, 3.0)
    q.release(14.0, 2.5)
    assert q.mean_in_use(16.0) == 0.0  # idle since the previous read
    fresh = AdmissionQueue(1, 0, 1.0)
    assert fresh.mean_in_use(5.0) == 0.0  # nothing yet; the next interval starts at 5
    fresh.offer(waiter(), 9.0)
    assert fresh.mean_in_use(10.0) == pytest.approx(1.0 / 5.0)


def test_shed_messages_carry_the_retry_after() -> None:
    shed = Shed("queue_full", 2.25, "the queue is full")
    assert shed.retry_after_header == "3"
    assert shed_retry_after(shed.message()) == pytest.approx(2.25)
    assert Shed("deadline", 0.01, "x").retry_after_header == "1"
    assert shed_retry_after("stage 1: engine died; retry after 2 s") is None


def test_parse_priority() -> None:
    assert parse_priority("HIGH") is HIGH and parse_priority(" low ") is LOW
    with pytest.raises(ValueError, match="high, normal, low"):
        parse_priority("urgent")


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        AdmissionQueue(0, 1, 1.0)
    with pytest.raises(ValueError):
        AdmissionQueue(1, -1, 1.0)
    assert math.isfinite(AdmissionQueue(1, 0, 1.0).retry_after_s())


def test_the_mean_wait_covers_the_admitted_and_the_oldest_still_waiting() -> None:
    q = full_queue()  # one slot, taken at 0
    assert q.mean_wait_s(0.0) == 0.0  # admitted at once: no wait
    a, b = waiter(at=1.0), waiter(tenant="t", at=1.5)
    q.offer(a, 1.0)
    q.offer(b, 1.5)
    assert q.release(2.0, 2.0) == [a]  # a waited 1 s
    assert q.mean_wait_s(2.0) == pytest.approx(1.0)  # b: 0.5 s so far
    # Nobody admitted since, and b still waits: its age, not a mean over nobody.
    assert q.mean_wait_s(4.5) == pytest.approx(3.0)
    assert q.release(5.0, 3.0) == [b]
    assert q.mean_wait_s(5.0) == pytest.approx(3.5)
    assert q.mean_wait_s(6.0) == 0.0  # the queue is empty and nobody came
