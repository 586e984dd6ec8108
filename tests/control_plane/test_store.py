"""Store logic (Lua scripts) against the session Redis, in-process."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.schema import InstanceState, LoadReport, RegisterRequest
from omni_mesh.control_plane.store.instances import InstanceStore, StateAction
from omni_mesh.control_plane.store.keys import KeySchema

pytestmark = pytest.mark.unit

KEYS = KeySchema()


def make_store(
    client: redis.asyncio.Redis, *, lease_ttl_ms: int = 3000, evict_after_ms: int = 60_000
) -> InstanceStore:
    return InstanceStore(client, KEYS, lease_ttl_ms=lease_ttl_ms, evict_after_ms=evict_after_ms)


def req(stage_id: int = 1, port: int = 9001, **kwargs: object) -> RegisterRequest:
    fields: dict[str, object] = {
        "pipeline": "tiny-omni",
        "stage_id": stage_id,
        "address": f"http://127.0.0.1:{port}",
        "capacity": 4,
    }
    fields.update(kwargs)
    return RegisterRequest.model_validate(fields)


async def test_register_lists_the_instance_in_its_pool(redis_client: redis.asyncio.Redis) -> None:
    store = make_store(redis_client)
    res = await store.register(req(labels={"zone": "a"}, host_id="node-1"))
    pool = await store.pool("tiny-omni", 1, healthy_only=True)
    assert pool.version == res.version
    [info] = pool.instances
    assert info.instance_id == res.instance_id
    assert info.epoch == res.epoch
    assert (info.address, info.host_id, info.capacity) == ("http://127.0.0.1:9001", "node-1", 4)
    assert info.labels == {"zone": "a"}
    assert info.state is InstanceState.HEALTHY
    assert info.load == LoadReport(capacity=4)
    assert 0 <= info.heartbeat_age_ms < 1000
    assert (await store.pool("tiny-omni", 0, healthy_only=True)).instances == ()
    assert await store.pipeline_names() == ["tiny-omni"]


async def test_host_id_defaults_to_the_address_host(redis_client: redis.asyncio.Redis) -> None:
    store = make_store(redis_client)
    await store.register(req(address="http://10.1.2.3:9000"))
    [info] = (await store.pool("tiny-omni", 1, healthy_only=True)).instances
    assert info.host_id == "10.1.2.3"


async def test_version_moves_on_membership_not_on_heartbeats(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    spec = get_pipeline("tiny-omni")
    first = await store.register(req())
    v1 = (await store.snapshot(spec)).version
    assert v1 == first.version
    hb = await store.heartbeat(first.instance_id, LoadReport(in_flight=3, capacity=4))
    assert hb is not None and hb.state is InstanceState.HEALTHY and not hb.revived
    snap = await store.snapshot(spec)
    assert snap.version == v1, "a load update must not bump the version"
    assert snap.healthy(1)[0].load.in_flight == 3
    second = await store.register(req(port=9002))
    assert second.version > v1
    assert second.epoch > first.epoch
    dereg = await store.deregister(first.instance_id)
    assert dereg is not None and dereg.version > second.version
    assert [i.instance_id for i in (await store.snapshot(spec)).healthy(1)] == [second.instance_id]


async def test_unknown_instance_everywhere(redis_client: redis.asyncio.Redis) -> None:
    store = make_store(redis_client)
    assert await store.heartbeat("nope", LoadReport()) is None
    assert await store.deregister("nope") is None
    assert await store.set_state("nope", StateAction.ISOLATE, "x") is None
    assert await store.instance("nope") is None


async def test_same_address_in_a_pool_supersedes_the_old_record(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    old = await store.register(req())
    new = await store.register(req())
    assert new.superseded == (old.instance_id,)
    pool = await store.pool("tiny-omni", 1, healthy_only=False)
    assert [i.instance_id for i in pool.instances] == [new.instance_id]
    assert await store.heartbeat(old.instance_id, LoadReport()) is None


async def test_registration_publishes_the_new_version(redis_client: redis.asyncio.Redis) -> None:
    store = make_store(redis_client)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(KEYS.channel("tiny-omni"))
    try:
        res = await store.register(req())
        message = None
        async with asyncio.timeout(5):
            while message is None:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        assert int(message["data"]) == res.version
    finally:
        await pubsub.aclose()


async def test_sweep_requires_the_lock(redis_client: redis.asyncio.Redis) -> None:
    store = make_store(redis_client)
    assert not (await store.sweep("not-the-holder", 1000)).held_lock
    assert await store.try_acquire_sweeper_lock("a", 1000)
    assert not await store.try_acquire_sweeper_lock("b", 1000)
    assert await store.try_acquire_sweeper_lock("a", 1000), "the holder may take it again"
    assert (await store.sweep("a", 1000)).held_lock
    assert not (await store.sweep("b", 1000)).held_lock
    assert not await store.release_sweeper_lock("b")
    assert await store.release_sweeper_lock("a")
    assert await store.try_acquire_sweeper_lock("b", 1000)


async def test_lapsed_lease_isolates_and_a_heartbeat_revives(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client, lease_ttl_ms=50)
    spec = get_pipeline("tiny-omni")
    res = await store.register(req())
    assert await store.try_acquire_sweeper_lock("t", 5000)
    await asyncio.sleep(0.1)
    swept = await store.sweep("t", 5000)
    assert [(e.kind, e.instance_id, e.previous_state) for e in swept.events] == [
        ("expired", res.instance_id, "healthy")
    ]
    after_expiry = await store.snapshot(spec)
    assert after_expiry.healthy(1) == ()
    assert after_expiry.version > res.version
    info = await store.instance(res.instance_id)
    assert info is not None
    assert (info.state, info.reason) == (InstanceState.ISOLATED, "lease_expired")
    assert (await store.sweep("t", 5000)).events == (), "expired once, not every tick"

    hb = await store.heartbeat(res.instance_id, LoadReport())
    assert hb is not None and hb.revived and hb.state is InstanceState.HEALTHY
    revived = await store.snapshot(spec)
    assert [i.instance_id for i in revived.healthy(1)] == [res.instance_id]
    assert revived.version > after_expiry.version


async def test_operator_isolation_and_drain_survive_heartbeats(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    a = await store.register(req(port=9001))
    b = await store.register(req(port=9002))
    iso = await store.set_state(a.instance_id, StateAction.ISOLATE, "bad gpu")
    assert iso is not None and iso.changed and iso.state is InstanceState.ISOLATED
    again = await store.set_state(a.instance_id, StateAction.ISOLATE, "bad gpu")
    assert again is not None and not again.changed
    drained = await store.set_state(b.instance_id, StateAction.DRAIN, "drain")
    assert drained is not None and drained.state is InstanceState.DRAINING
    for instance_id, state in ((a.instance_id, "isolated"), (b.instance_id, "draining")):
        hb = await store.heartbeat(instance_id, LoadReport())
        assert hb is not None and hb.state == state and not hb.revived
    assert (await store.pool("tiny-omni", 1, healthy_only=True)).instances == ()
    readmitted = await store.set_state(a.instance_id, StateAction.READMIT)
    assert readmitted is not None and readmitted.state is InstanceState.HEALTHY
    healthy = await store.pool("tiny-omni", 1, healthy_only=True)
    assert [i.instance_id for i in healthy.instances] == [a.instance_id]


async def test_readmitting_a_dead_instance_waits_for_its_heartbeat(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client, lease_ttl_ms=50)
    res = await store.register(req())
    await store.set_state(res.instance_id, StateAction.ISOLATE, "operator")
    await asyncio.sleep(0.1)
    out = await store.set_state(res.instance_id, StateAction.READMIT)
    assert out is not None
    assert (out.state, out.reason) == (InstanceState.ISOLATED, "lease_expired")
    hb = await store.heartbeat(res.instance_id, LoadReport())
    assert hb is not None and hb.state is InstanceState.HEALTHY


async def test_isolate_unreachable_is_atomic_versioned_and_published(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    spec = get_pipeline("tiny-omni")
    res = await store.register(req())
    before = await store.snapshot(spec)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(KEYS.channel("tiny-omni"))
    try:
        out = await store.isolate_unreachable(res.instance_id)
        assert out is not None and out.changed
        assert (out.state, out.reason) == (InstanceState.ISOLATED, "unreachable")
        message = None
        async with asyncio.timeout(5):
            while message is None:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
    finally:
        await pubsub.aclose()
    after = await store.snapshot(spec)
    assert after.healthy(1) == () and int(message["data"]) == after.version > before.version
    again = await store.isolate_unreachable(res.instance_id)
    assert again is not None and not again.changed
    assert (await store.snapshot(spec)).version == after.version, "no change, no bump"
    assert await store.isolate_unreachable("nope") is None


async def test_isolate_unreachable_leaves_other_states_alone(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    a = await store.register(req(port=9001))
    b = await store.register(req(port=9002))
    await store.set_state(a.instance_id, StateAction.ISOLATE, "bad gpu")
    await store.set_state(b.instance_id, StateAction.DRAIN, "drain")
    for instance_id, state, reason in (
        (a.instance_id, InstanceState.ISOLATED, "bad gpu"),
        (b.instance_id, InstanceState.DRAINING, "drain"),
    ):
        out = await store.isolate_unreachable(instance_id)
        assert out is not None and not out.changed and (out.state, out.reason) == (state, reason)


async def test_heartbeat_readmits_an_unreachable_instance_after_the_grace(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    store.readmit_grace_ms = 200
    res = await store.register(req())
    await store.isolate_unreachable(res.instance_id)
    early = await store.heartbeat(res.instance_id, LoadReport())
    assert early is not None and not early.revived, "a heartbeat sent before the death"
    assert (early.state, early.reason) == (InstanceState.ISOLATED, "unreachable")
    await asyncio.sleep(0.25)
    hb = await store.heartbeat(res.instance_id, LoadReport())
    assert hb is not None and hb.revived and hb.previous_reason == "unreachable"
    assert hb.state is InstanceState.HEALTHY
    healthy = await store.pool("tiny-omni", 1, healthy_only=True)
    assert [i.instance_id for i in healthy.instances] == [res.instance_id]


async def test_an_unreachable_instance_keeps_its_reason_when_its_lease_lapses(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client, lease_ttl_ms=50)
    store.readmit_grace_ms = 0
    res = await store.register(req())
    await store.isolate_unreachable(res.instance_id)
    assert await store.try_acquire_sweeper_lock("t", 5000)
    await asyncio.sleep(0.1)
    assert (await store.sweep("t", 5000)).events == (), "already isolated: no expiry event"
    info = await store.instance(res.instance_id)
    assert info is not None and (info.state, info.reason) == (InstanceState.ISOLATED, "unreachable")
    assert await redis_client.zscore(KEYS.evict, res.instance_id) is not None, "evicted later"
    hb = await store.heartbeat(res.instance_id, LoadReport())
    assert hb is not None and hb.revived, "a heartbeat still brings it back"


async def test_dead_records_are_evicted(redis_client: redis.asyncio.Redis) -> None:
    store = make_store(redis_client, lease_ttl_ms=50, evict_after_ms=0)
    res = await store.register(req())
    assert await store.try_acquire_sweeper_lock("t", 5000)
    await asyncio.sleep(0.1)
    first = await store.sweep("t", 5000)
    second = await store.sweep("t", 5000)
    kinds = [e.kind for e in (*first.events, *second.events)]
    assert kinds == ["expired", "evicted"]
    assert await store.instance(res.instance_id) is None
    assert await store.heartbeat(res.instance_id, LoadReport()) is None
    assert await redis_client.zscore(KEYS.leases, res.instance_id) is None
    assert await redis_client.scard(KEYS.pool("tiny-omni", 1)) == 0


async def test_versions_keep_growing_after_redis_lost_its_data(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = make_store(redis_client)
    before = await store.register(req())
    await redis_client.flushall()
    after = await store.register(req(port=9002))
    assert after.version > before.version
    assert after.epoch > before.epoch


async def test_keys_share_one_prefix() -> None:
    keys = KeySchema()
    names = [
        keys.instance("x"),
        keys.pool("p", 0),
        keys.version("p"),
        keys.channel("p"),
        keys.pipelines,
        keys.leases,
        keys.evict,
        keys.epoch,
        keys.sweeper_lock,
    ]
    assert all(n.startswith("omni:") for n in names)
    assert len(set(names)) == len(names)
    assert keys.pipeline_of_channel(keys.channel("tiny-tts")) == "tiny-tts"
    assert keys.pipeline_of_channel("other") is None
