"""Session affinity in the router (``sidecar/hop/affinity.py``): a session's hops go to one
replica while it has room, every sender picks the same one from the same pool, sessions spread
over the replicas, a replica past 1.25x the pool's mean load (or at its capacity) spills its
sessions to their next replica and takes them back, an ejected or departed replica's go
elsewhere and only theirs move; and the keys the API server
derives for a request (``sidecar/api/affinity_keys.py``)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from aiohttp.test_utils import make_mocked_request

from omni_mesh.sidecar.api.affinity_keys import (
    SESSION_HEADER,
    affinity_key,
    conversation_start,
    named,
    prompt_prefix,
)
from omni_mesh.sidecar.errors import ApiError
from omni_mesh.sidecar.hop.affinity import ranked
from omni_mesh.sidecar.hop.router import Router
from tests.sidecar.test_router import HOST, FakePools, replica

pytestmark = pytest.mark.unit


def routers(pools: FakePools, n: int = 2) -> list[Router]:
    """``n`` senders (API servers) over the same pools, each with its own random draws."""
    return [Router(pools, host_id=HOST, rng=random.Random(i)) for i in range(n)]


def pick(router: Router, key: str, exclude: set[str] | None = None) -> str:
    chosen = router.pick(1, exclude=exclude or set(), prefer_same_host=False, affinity=key)
    assert chosen is not None
    return chosen.instance_id


def test_a_session_keeps_to_one_replica_and_every_sender_agrees() -> None:
    pools = FakePools(*(replica(f"r{i}") for i in range(4)))
    a, b = routers(pools)
    for key in (f"session-{i}" for i in range(20)):
        homes = {pick(a, key) for _ in range(10)} | {pick(b, key) for _ in range(10)}
        assert len(homes) == 1, (key, homes)
        assert homes == {a.home(1, key, prefer_same_host=False)}


def test_sessions_spread_over_the_replicas() -> None:
    pools = FakePools(*(replica(f"r{i}") for i in range(4)))
    (router,) = routers(pools, 1)
    counts = Counter(pick(router, f"user-{i}") for i in range(400))
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert min(counts.values()) > 50, counts  # 100 each on average


def test_a_busy_replica_spills_its_sessions_to_their_next_and_takes_them_back() -> None:
    pools = FakePools(*(replica(f"r{i}", capacity=8) for i in range(3)))
    (router,) = routers(pools, 1)
    key = "busy-session"
    home, second, third = (r.instance_id for r in ranked(key, list(pools.replicas(1))))
    assert pick(router, key) == home
    router.begin(home)  # 1 in flight there, none elsewhere: past 1.25x the mean with one more
    assert pick(router, key) == second
    router.begin(second)
    router.begin(third)  # the mean rose to 1: its replica has room again
    assert pick(router, key) == home
    # its own report (every sender's traffic) counts as much as this sender's
    for r in (second, third):
        router.end(r)
    router.end(home)
    pools.pools[1] = [
        replica(r.instance_id, capacity=8, reported=5 if r.instance_id == home else 0)
        for r in pools.replicas(1)
    ]
    assert pick(router, key) == second


def test_a_replica_at_capacity_takes_no_more_of_its_sessions() -> None:
    pools = FakePools(replica("r0", capacity=1), replica("r1", capacity=1), replica("r2"))
    (router,) = routers(pools, 1)
    key = next(
        f"k{i}"
        for i in range(100)
        if ranked(f"k{i}", list(pools.replicas(1)))[0].instance_id == "r0"
    )
    router.begin("r1")
    router.begin("r2")
    router.begin("r2")
    assert pick(router, key) == "r0"  # under the bound (ceil(1.25 * 4 / 3) = 2) and capacity
    router.begin("r0")
    router.begin("r2")  # the mean rises; r0 is at its capacity of 1 all the same
    assert pick(router, key) != "r0"


def test_when_every_replica_is_full_the_less_loaded_of_two_takes_it() -> None:
    pools = FakePools(replica("r0", capacity=1), replica("r1", capacity=1))
    (router,) = routers(pools, 1)
    router.begin("r0")
    router.begin("r0")
    router.begin("r1")
    assert pick(router, "any") == "r1"  # 1 of 1 against 2 of 1


def test_an_ejected_or_departed_replica_moves_only_its_sessions() -> None:
    pools = FakePools(*(replica(f"r{i}") for i in range(4)))
    (router,) = routers(pools, 1)
    keys = [f"conversation-{i}" for i in range(200)]
    before = {key: pick(router, key) for key in keys}
    router.eject("r2", "connection refused")
    ejected = {key: pick(router, key) for key in keys}
    assert "r2" not in ejected.values()
    assert all(ejected[k] == before[k] for k in keys if before[k] != "r2")
    pools.pools[1] = [r for r in pools.replicas(1) if r.instance_id != "r2"]
    assert {key: pick(router, key) for key in keys} == ejected  # left: the same moves
    pools.pools[1].append(replica("r4"))  # a new replica takes only the sessions it wins
    joined = {key: pick(router, key) for key in keys}
    moved = [k for k in keys if joined[k] != ejected[k]]
    assert moved and all(joined[k] == "r4" for k in moved)
    assert len(moved) < len(keys) / 2


def test_a_split_stages_prefill_pool_is_picked_by_its_load_not_the_session() -> None:
    pools = FakePools(
        replica("p0", kv_role="prefill", reported_tokens=500),
        replica("p1", kv_role="prefill"),
        replica("d0", kv_role="decode"),
    )
    (router,) = routers(pools, 1)
    for i in range(10):
        chosen = router.pick(
            1, exclude=set(), prefer_same_host=False, prefill=True, affinity=f"s{i}"
        )
        assert chosen is not None and chosen.instance_id == "p1"


# ---- the API server's keys -------------------------------------------------------------------


def test_the_header_wins_and_a_malformed_one_is_a_400_naming_it() -> None:
    plain = make_mocked_request("POST", "/v1/chat/completions")
    assert affinity_key(plain, None, "route-key") == "route-key"
    assert affinity_key(plain) == ""
    headed = make_mocked_request("POST", "/v1/chat/completions", headers={SESSION_HEADER: "s-1"})
    key = affinity_key(headed, "route-key")
    assert key.startswith("session:") and "s-1" not in key
    bad = make_mocked_request("POST", "/", headers={SESSION_HEADER: "two words"})
    with pytest.raises(ApiError) as err:
        affinity_key(bad)
    assert err.value.status == 400 and SESSION_HEADER in err.value.message


def test_a_conversations_follow_ups_share_its_key() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    follow_up = [
        *first,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "?"},
    ]
    other = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]
    assert conversation_start(first) == conversation_start(follow_up)
    assert conversation_start(first) != conversation_start(other)
    assert conversation_start([{"role": "system", "content": "x"}]) is None
    assert prompt_prefix("a" * 600 + "tail 1") == prompt_prefix("a" * 600 + "tail 2")
    assert prompt_prefix([1, 2, 3]) != prompt_prefix([1, 2, 4])
    assert named("user", "alice") != named("cache", "alice") and named("user", None) is None
