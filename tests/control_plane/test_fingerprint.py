"""Pipeline-wide settings are fingerprinted at registration (the REGISTER script): a pod that
disagrees with the live pods of its pipeline is refused, naming the setting; the fingerprint is
released when the pipeline's last instance leaves or its lease lapses."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from omni_mesh.configs.deploy import DeployConfig
from omni_mesh.configs.fingerprint import pipeline_fingerprint
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.schema import LoadReport, RegisterRequest
from omni_mesh.control_plane.store.instances import InstanceStore, SettingsConflict
from omni_mesh.control_plane.store.keys import KeySchema

pytestmark = pytest.mark.unit

KEYS = KeySchema()
STAGES = get_pipeline("tiny-omni").stage_ids


def req(stage_id: int, port: int, **settings: str) -> RegisterRequest:
    return RegisterRequest(
        pipeline="tiny-omni",
        stage_id=stage_id,
        address=f"http://127.0.0.1:{port}",
        capacity=4,
        settings={"async_chunk": "false", "stages": "abc", **settings},
    )


def store_of(client: redis.asyncio.Redis, lease_ttl_ms: int = 3000) -> InstanceStore:
    return InstanceStore(client, KEYS, lease_ttl_ms=lease_ttl_ms, evict_after_ms=60_000)


async def test_a_disagreeing_pod_is_refused_naming_the_setting(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = store_of(redis_client)
    await store.register(req(0, 9001), STAGES)
    await store.register(req(2, 9002), STAGES)  # agrees: fine, any stage
    with pytest.raises(SettingsConflict) as exc:
        await store.register(req(1, 9003, async_chunk="true"), STAGES)
    assert (exc.value.setting, exc.value.theirs, exc.value.ours) == ("async_chunk", "false", "true")
    with pytest.raises(SettingsConflict, match="stages: xyz here, abc in the pods"):
        await store.register(req(1, 9003, stages="xyz"), STAGES)
    assert (await store.pool("tiny-omni", 1, healthy_only=False)).instances == ()


async def test_released_when_the_last_pod_leaves(redis_client: redis.asyncio.Redis) -> None:
    store = store_of(redis_client)
    first = await store.register(req(0, 9001), STAGES)
    second = await store.register(req(1, 9002), STAGES)
    await store.deregister(first.instance_id)
    with pytest.raises(SettingsConflict):  # one pod still holds the old setting
        await store.register(req(2, 9003, async_chunk="true"), STAGES)
    await store.deregister(second.instance_id)
    await store.register(req(2, 9003, async_chunk="true"), STAGES)
    with pytest.raises(SettingsConflict, match="async_chunk: false here, true"):
        await store.register(req(0, 9004), STAGES)


async def test_released_when_the_leases_lapse(redis_client: redis.asyncio.Redis) -> None:
    store = store_of(redis_client, lease_ttl_ms=150)
    await store.register(req(0, 9001), STAGES)
    await asyncio.sleep(0.3)  # no heartbeat: the lease lapsed (not yet swept)
    await store.register(req(1, 9002, async_chunk="true"), STAGES)


async def test_a_restarted_replica_may_change_the_setting_when_alone(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = store_of(redis_client)
    await store.register(req(1, 9001), STAGES)
    await store.register(req(1, 9001, async_chunk="true"), STAGES)  # same address: replaces it


async def test_a_pod_back_from_a_lapsed_lease_is_checked_again(
    redis_client: redis.asyncio.Redis,
) -> None:
    """While its lease had lapsed a pipeline with another setting registered: the heartbeat
    that would readmit it is refused naming the setting, and changes nothing."""
    store = store_of(redis_client, lease_ttl_ms=150)
    away = await store.register(req(1, 9001), STAGES)
    await asyncio.sleep(0.3)  # lapsed
    assert await store.heartbeat(away.instance_id, LoadReport()) is not None  # nothing changed
    await asyncio.sleep(0.3)
    other = await store.register(req(2, 9002, async_chunk="true"), STAGES)
    lease_before = await redis_client.zscore(KEYS.leases, away.instance_id)
    with pytest.raises(SettingsConflict) as exc:
        await store.heartbeat(away.instance_id, LoadReport())
    assert (exc.value.setting, exc.value.theirs, exc.value.ours) == ("async_chunk", "true", "false")
    assert await redis_client.zscore(KEYS.leases, away.instance_id) == lease_before  # not renewed
    assert await store.heartbeat(other.instance_id, LoadReport()) is not None
    assert await store.try_acquire_sweeper_lock("t", 1000)
    assert (await store.sweep("t", 1000)).events  # the sweeper isolates it (lease_expired) ...
    with pytest.raises(SettingsConflict):  # ... and a heartbeat still does not readmit it
        await store.heartbeat(away.instance_id, LoadReport())
    pool = await store.pool("tiny-omni", 1, healthy_only=False)
    assert [i.state.value for i in pool.instances] == ["isolated"]


def test_the_fingerprint_names_streaming_and_the_stage_list() -> None:
    omni, tts = get_pipeline("tiny-omni"), get_pipeline("tiny-tts")
    on = pipeline_fingerprint(omni, DeployConfig(async_chunk=True))
    off = pipeline_fingerprint(omni, DeployConfig())
    assert (on["async_chunk"], off["async_chunk"]) == ("true", "false")
    assert on["stages"] == off["stages"] != pipeline_fingerprint(tts, DeployConfig())["stages"]
