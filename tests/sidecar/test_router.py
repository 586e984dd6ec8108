"""Router: power of two choices on in-flight load, exclusion, ejection, same-host preference."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterable

import pytest

from omni_mesh.sidecar.hop.router import Replica, Router

pytestmark = pytest.mark.unit

HOST = "host-a"


class FakePools:
    """A PoolView over a plain dict, changed by the test as discovery would."""

    def __init__(self, *replicas: Replica) -> None:
        self.pools: dict[int, list[Replica]] = {}
        for r in replicas:
            self.pools.setdefault(r.stage_id, []).append(r)

    def replicas(self, stage_id: int) -> Iterable[Replica]:
        return list(self.pools.get(stage_id, ()))


def replica(
    name: str,
    *,
    stage_id: int = 1,
    host: str = "host-b",
    capacity: int = 8,
    reported: int = 0,
    kv_role: str = "",
    reported_tokens: int = 0,
) -> Replica:
    return Replica(
        instance_id=name,
        stage_id=stage_id,
        address=f"http://{name}.invalid:1",
        host_id=host,
        capacity=capacity,
        reported_in_flight=reported,
        kv_role=kv_role,
        reported_prefill_tokens=reported_tokens,
    )


def prefill_replica(name: str, *, reported: int = 0, reported_tokens: int = 0) -> Replica:
    return replica(name, kv_role="prefill", reported=reported, reported_tokens=reported_tokens)


def make_router(*replicas: Replica, seed: int = 1, eject_s: float = 5.0) -> Router:
    return Router(FakePools(*replicas), host_id=HOST, eject_s=eject_s, rng=random.Random(seed))


def picks(
    router: Router,
    n: int = 300,
    *,
    exclude: set[str] | None = None,
    prefer_same_host: bool = False,
) -> Counter[str | None]:
    """How often each replica is picked in ``n`` picks (``None``: no replica)."""
    out: Counter[str | None] = Counter()
    for _ in range(n):
        r = router.pick(1, exclude=exclude or set(), prefer_same_host=prefer_same_host)
        out[r.instance_id if r else None] += 1
    return out


def prefill_picks(router: Router, n: int = 300) -> Counter[str | None]:
    """How often each replica of stage 1's prefill pool is picked in ``n`` picks."""
    out: Counter[str | None] = Counter()
    for _ in range(n):
        r = router.pick(1, exclude=set(), prefer_same_host=False, prefill=True)
        out[r.instance_id if r else None] += 1
    return out


def load(router: Router, instance_id: str, n: int, *, prefill_tokens: int = 0) -> None:
    for _ in range(n):
        router.begin(instance_id, prefill_tokens=prefill_tokens)


# ---- power of two choices --------------------------------------------------------------------


def test_empty_pool_gives_none_and_single_replica_is_picked() -> None:
    assert make_router().pick(1, exclude=set(), prefer_same_host=False) is None
    only = replica("only")
    router = make_router(only)
    load(router, "only", 100)
    assert router.pick(1, exclude=set(), prefer_same_host=False) == only


def test_of_two_replicas_the_less_loaded_is_always_picked() -> None:
    router = make_router(replica("a"), replica("b"))
    load(router, "a", 3)
    assert picks(router) == {"b": 300}
    load(router, "b", 5)
    assert picks(router) == {"a": 300}


def test_p2c_never_picks_the_most_loaded_and_favours_the_least() -> None:
    router = make_router(replica("idle"), replica("busy"), replica("busiest"))
    load(router, "busy", 4)
    load(router, "busiest", 8)
    counts = picks(router, 600)
    assert counts["busiest"] == 0
    # "idle" wins whenever it is one of the two sampled (2 pairs in 3), "busy" otherwise.
    assert counts["idle"] > counts["busy"] > 0
    assert 330 < counts["idle"] < 470


def test_a_seeded_rng_makes_choices_reproducible() -> None:
    pool = [replica(f"r{i}") for i in range(5)]
    runs = []
    for _ in range(2):
        router = make_router(*pool, seed=7)
        runs.append([router.pick(1, exclude=set(), prefer_same_host=False) for _ in range(50)])
    assert runs[0] == runs[1]
    assert len({r.instance_id for r in runs[0] if r}) == 5  # equal load: all get picked


def test_load_is_relative_to_capacity() -> None:
    big, small = replica("big", capacity=16), replica("small", capacity=2)
    router = make_router(big, small)
    load(router, "big", 6)  # 6/16 busy
    load(router, "small", 1)  # 1/2 busy
    assert picks(router, 50) == {"big": 50}


def test_reported_load_counts_when_higher_than_our_own() -> None:
    router = make_router(replica("quiet"), replica("shared", reported=6))
    load(router, "quiet", 2)  # we sent 2 there; other routers sent 6 to "shared"
    assert picks(router, 50) == {"quiet": 50}
    load(router, "shared", 1)  # ours (1) is below its report (6): the report still counts
    assert picks(router, 50) == {"quiet": 50}


def test_only_replicas_of_the_requested_stage_are_picked() -> None:
    router = make_router(replica("s1"), replica("s2", stage_id=2), replica("s2b", stage_id=2))
    assert picks(router, 50) == {"s1": 50}
    got = {router.pick(2, exclude=set(), prefer_same_host=False) for _ in range(50)}
    assert {r.instance_id for r in got if r} == {"s2", "s2b"}
    assert router.pick(3, exclude=set(), prefer_same_host=False) is None


# ---- exclusion and ejection ------------------------------------------------------------------


def test_excluded_replicas_are_never_picked() -> None:
    router = make_router(replica("a"), replica("b"), replica("c"))
    load(router, "b", 5)
    load(router, "c", 5)
    assert picks(router, exclude={"a"}).keys() <= {"b", "c"}
    assert picks(router, exclude={"a", "b"}) == {"c": 300}
    assert picks(router, exclude={"a", "b", "c"}) == {None: 300}
    assert [r.instance_id for r in router.candidates(1, {"a"})] == ["b", "c"]


def test_an_ejected_replica_is_skipped_until_eject_s_has_passed() -> None:
    router = make_router(replica("bad"), replica("good"), eject_s=0.2)
    load(router, "good", 10)  # "bad" would win on load
    router.eject("bad", "connection refused")
    assert picks(router) == {"good": 300}
    assert [r.instance_id for r in router.candidates(1, set())] == ["good"]
    time.sleep(0.25)
    assert picks(router, 10) == {"bad": 10}


def test_ejecting_every_replica_empties_the_pool_for_a_while() -> None:
    router = make_router(replica("a"), replica("b"), eject_s=0.2)
    router.eject("a", "status 503")
    router.eject("b", "status 503")
    assert router.pick(1, exclude=set(), prefer_same_host=False) is None
    time.sleep(0.25)
    assert router.pick(1, exclude=set(), prefer_same_host=False) is not None


def test_an_ejected_replica_that_left_the_pool_does_not_come_back() -> None:
    pools = FakePools(replica("a"), replica("b"))
    router = Router(pools, host_id=HOST, eject_s=0.05, rng=random.Random(3))
    router.eject("a", "reset")
    pools.pools[1] = [r for r in pools.pools[1] if r.instance_id != "a"]
    time.sleep(0.1)
    assert picks(router, 20) == {"b": 20}


# ---- same-host preference --------------------------------------------------------------------


def test_same_host_is_preferred_only_when_asked() -> None:
    router = make_router(replica("local", host=HOST), replica("far1"), replica("far2"))
    load(router, "local", 20)  # the local replica is by far the busiest
    assert picks(router, prefer_same_host=True) == {"local": 300}
    counts = picks(router, prefer_same_host=False)
    assert counts["local"] == 0 and counts["far1"] > 0 and counts["far2"] > 0


def test_p2c_runs_among_same_host_replicas() -> None:
    router = make_router(replica("local1", host=HOST), replica("local2", host=HOST), replica("far"))
    load(router, "local1", 3)
    assert picks(router, prefer_same_host=True) == {"local2": 300}


def test_same_host_preference_falls_back_to_other_hosts() -> None:
    router = make_router(replica("local", host=HOST), replica("far1"), replica("far2"))
    assert picks(router, prefer_same_host=True, exclude={"local"}).keys() == {"far1", "far2"}
    router.eject("local", "connection refused")
    assert picks(router, prefer_same_host=True).keys() == {"far1", "far2"}
    remote_only = make_router(replica("far1"), replica("far2"))
    assert picks(remote_only, prefer_same_host=True).keys() == {"far1", "far2"}


# ---- begin / end accounting ------------------------------------------------------------------


def test_begin_and_end_count_in_flight_per_replica() -> None:
    router = make_router(replica("a"), replica("b"))
    assert router.in_flight("a") == 0
    load(router, "a", 3)
    router.begin("b")
    assert (router.in_flight("a"), router.in_flight("b")) == (3, 1)
    router.end("a")
    assert router.in_flight("a") == 2
    router.end("b")
    assert router.in_flight("b") == 0
    router.end("b")  # an unmatched end never goes negative
    router.end("never-seen")
    assert (router.in_flight("b"), router.in_flight("never-seen")) == (0, 0)
    router.begin("b")
    assert router.in_flight("b") == 1


def test_in_flight_accounting_steers_the_next_picks() -> None:
    router = make_router(replica("a"), replica("b"))
    chosen = []
    for _ in range(6):  # hops that stay open: load spreads evenly
        r = router.pick(1, exclude=set(), prefer_same_host=False)
        assert r is not None
        router.begin(r.instance_id)
        chosen.append(r.instance_id)
    assert Counter(chosen) == {"a": 3, "b": 3}
    for name in chosen:
        router.end(name)
    assert (router.in_flight("a"), router.in_flight("b")) == (0, 0)


# ---- a split stage's prefill pool: prompt tokens queued --------------------------------------


def test_a_prefill_goes_to_fewer_queued_tokens_not_fewer_requests() -> None:
    router = make_router(prefill_replica("long"), prefill_replica("short"))
    load(router, "long", 1, prefill_tokens=4000)  # one long prompt
    load(router, "short", 3, prefill_tokens=100)  # three short ones: 300 tokens
    assert prefill_picks(router) == {"short": 300}
    # The decode pool's picks stay by requests: the same counts there pick the other way.
    decode = make_router(replica("long"), replica("short"))
    load(decode, "long", 1, prefill_tokens=4000)
    load(decode, "short", 3, prefill_tokens=100)
    assert picks(decode) == {"long": 300}


def test_p2c_on_prefill_tokens_never_picks_the_most_queued_and_favours_the_least() -> None:
    router = make_router(prefill_replica("idle"), prefill_replica("busy"), prefill_replica("max"))
    load(router, "busy", 1, prefill_tokens=500)
    load(router, "max", 1, prefill_tokens=5000)
    counts = prefill_picks(router, 600)
    assert counts["max"] == 0 and counts["idle"] > counts["busy"] > 0


def test_the_reported_queue_counts_when_higher_than_our_own() -> None:
    # Other senders queued 5000 tokens on "shared"; we sent 800 to "quiet".
    router = make_router(prefill_replica("quiet"), prefill_replica("shared", reported_tokens=5000))
    load(router, "quiet", 1, prefill_tokens=800)
    assert prefill_picks(router, 50) == {"quiet": 50}
    load(router, "shared", 2, prefill_tokens=100)  # ours (200) below its report: it counts
    assert prefill_picks(router, 50) == {"quiet": 50}
    # Our own count wins over a report that has not seen it yet (a heartbeat old).
    stale = make_router(prefill_replica("a", reported_tokens=100), prefill_replica("b"))
    load(stale, "a", 1, prefill_tokens=3000)
    load(stale, "b", 1, prefill_tokens=1000)
    assert prefill_picks(stale, 50) == {"b": 50}


def test_equal_queued_tokens_are_broken_by_requests_in_flight() -> None:
    router = make_router(prefill_replica("a", reported_tokens=700), prefill_replica("b"))
    load(router, "b", 1, prefill_tokens=700)  # the same tokens queued on each …
    load(router, "b", 1)  # … and one more request in flight on "b"
    assert prefill_picks(router, 50) == {"a": 50}
    reported = make_router(prefill_replica("a", reported=3), prefill_replica("b", reported=1))
    assert prefill_picks(reported, 50) == {"b": 50}


def test_prefill_tokens_begin_and_end_balance_per_replica() -> None:
    router = make_router(prefill_replica("a"), prefill_replica("b"))
    router.begin("a", prefill_tokens=300)
    router.begin("a", prefill_tokens=50)
    router.begin("b", prefill_tokens=7)
    assert (router.prefill_tokens("a"), router.prefill_tokens("b")) == (350, 7)
    assert (router.in_flight("a"), router.in_flight("b")) == (2, 1)
    router.end("a", prefill_tokens=300)
    assert (router.prefill_tokens("a"), router.in_flight("a")) == (50, 1)
    router.end("a", prefill_tokens=50)
    router.end("b", prefill_tokens=7)
    assert [router.prefill_tokens(n) for n in ("a", "b")] == [0, 0]
    router.end("b", prefill_tokens=7)  # an unmatched end never goes negative
    assert router.prefill_tokens("b") == 0
    router.begin("b")  # a request that is no prefill adds no tokens
    assert (router.prefill_tokens("b"), router.in_flight("b")) == (0, 1)
