"""The sidecar-side helpers against real omni-cp processes: InstanceLease and PoolWatcher,
including the control plane or its Redis going away (DESIGN invariants 5 and 6)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis.asyncio

from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    ControlPlaneUnavailableError,
    InstanceLease,
    InstanceState,
    LoadReport,
    PoolWatcher,
    RegisterRequest,
)
from omni_mesh.control_plane.store.keys import KeySchema
from tests.procs import ControlPlaneProcess, RedisServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

FAST = {"heartbeat_interval_ms": 200, "lease_ttl_ms": 1000, "sweep_interval_ms": 100}


def request(port: int, stage_id: int = 1) -> RegisterRequest:
    return RegisterRequest(
        pipeline="tiny-omni", stage_id=stage_id, address=f"http://127.0.0.1:{port}", capacity=8
    )


async def listed(client: ControlPlaneClient, instance_id: str | None, stage_id: int = 1) -> bool:
    pool = await client.instances("tiny-omni", stage_id)
    return instance_id in {i.instance_id for i in pool.instances}


async def eventually(check: Callable[[], object], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"timed out after {within_s}s: {what}"
        await asyncio.sleep(0.05)


async def test_lease_registers_heartbeats_and_leaves(
    cp_factory: Callable[..., ControlPlaneProcess],
) -> None:
    cp = cp_factory(**FAST)
    load = LoadReport(in_flight=5, queued=1, capacity=8)
    async with ControlPlaneClient([cp.url]) as client:
        lease = InstanceLease(client, request(9601), lambda: load)
        registration = await lease.start()
        assert lease.registered and lease.instance_id == registration.instance_id
        assert lease.epoch == registration.epoch
        assert lease.heartbeat_interval_s == pytest.approx(0.2)
        await asyncio.sleep(1.5)  # longer than the lease: heartbeats keep it healthy

        async def reports_load() -> bool:
            pool = await client.instances("tiny-omni", 1)
            return any(i.load == load for i in pool.instances)

        await eventually(reports_load, 2, "the load reported by load_fn")
        assert lease.state is InstanceState.HEALTHY
        await lease.stop()
        assert not lease.registered
        assert not await listed(client, registration.instance_id)


async def test_lease_reregisters_after_redis_restarted_empty(
    cp_factory: Callable[..., ControlPlaneProcess],
    private_redis_factory: Callable[[], RedisServer],
) -> None:
    redis_server = private_redis_factory()
    cp = cp_factory(redis_url=redis_server.url, **FAST)
    async with ControlPlaneClient([cp.url]) as client:
        lease = InstanceLease(client, request(9602), LoadReport, backoff_max_s=0.5)
        first = await lease.start()
        assert await listed(client, first.instance_id)
        await asyncio.to_thread(redis_server.restart_empty)

        async def reregistered() -> bool:
            return lease.instance_id != first.instance_id and await listed(
                client, lease.instance_id
            )

        await eventually(reregistered, 10, "re-registration through the 404 path")
        assert lease.epoch is not None and lease.epoch > first.epoch
        assert lease.registrations == 2
        await lease.stop()


async def test_watcher_keeps_its_pools_while_the_control_plane_is_down(
    cp_factory: Callable[..., ControlPlaneProcess],
) -> None:
    port = free_port()
    cp = cp_factory(port=port, **FAST)
    async with ControlPlaneClient([cp.url], timeout_s=1.0) as client:
        lease = InstanceLease(client, request(9603), LoadReport, backoff_max_s=0.5)
        first = await lease.start()
        changes: list[int] = []
        watcher = PoolWatcher(
            client,
            "tiny-omni",
            resync_interval_s=2.0,
            backoff_max_s=0.3,
            on_change=lambda s: changes.append(s.version),
        )
        await watcher.start()
        try:
            snap = await watcher.wait_for(
                lambda s: first.instance_id in {i.instance_id for i in s.healthy(1)}, 5
            )
            assert watcher.version == snap.version and changes
            assert watcher.connected

            await asyncio.to_thread(cp.terminate)
            await eventually(lambda: not watcher.connected, 5, "watcher notices the outage")
            await asyncio.sleep(1.0)
            assert [i.instance_id for i in watcher.healthy(1)] == [first.instance_id]
            with pytest.raises(ControlPlaneUnavailableError):
                await client.instances("tiny-omni", 1)

            cp_factory(port=port, **FAST)  # the same URL answers again
            second = await client.register(request(9604))
            await watcher.wait_for(
                lambda s: second.instance_id in {i.instance_id for i in s.healthy(1)}, 10
            )
            assert watcher.connected
            await eventually(
                lambda: first.instance_id in {i.instance_id for i in watcher.healthy(1)},
                5,
                "the lease's instance is healthy again after the outage",
            )
        finally:
            await watcher.stop()
            await lease.stop()


async def test_watcher_resyncs_without_notifications(
    cp_factory: Callable[..., ControlPlaneProcess], redis_url: str
) -> None:
    """A change made behind omni-cp's back (no PUBLISH) still reaches the watcher within
    about one resync interval: notifications are hints, state is the truth."""
    cp = cp_factory(redis_url=redis_url, **FAST)
    keys = KeySchema()
    async with ControlPlaneClient([cp.url]) as client:
        lease = InstanceLease(client, request(9605, stage_id=2), LoadReport)
        registration = await lease.start()
        watcher = PoolWatcher(client, "tiny-omni", resync_interval_s=1.0)
        await watcher.start()
        raw = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            await watcher.wait_for(lambda s: len(s.healthy(2)) == 1, 5)
            await raw.hset(keys.instance(registration.instance_id), "state", "draining")
            await raw.incr(keys.version("tiny-omni"))
            started = time.monotonic()
            await watcher.wait_for(lambda s: s.healthy(2) == (), 5)
            assert time.monotonic() - started < 1.0 + 1.0
        finally:
            await raw.aclose()
            await watcher.stop()
            await lease.stop()


async def test_client_fails_over_to_the_next_url(
    control_plane: ControlPlaneProcess,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with ControlPlaneClient([dead, control_plane.url]) as client:
        registration = await client.register(request(9606))
        assert await listed(client, registration.instance_id)
        assert client.urls == (dead, control_plane.url)
    async with ControlPlaneClient([dead], timeout_s=0.5) as client:
        with pytest.raises(ControlPlaneUnavailableError, match="no control plane answered"):
            await client.health()


async def test_lease_start_keeps_trying_until_the_control_plane_appears(
    cp_factory: Callable[..., ControlPlaneProcess],
) -> None:
    port = free_port()
    async with ControlPlaneClient([f"http://127.0.0.1:{port}"], timeout_s=1.0) as client:
        lease = InstanceLease(client, request(9607), LoadReport, backoff_max_s=0.3)
        starting = asyncio.create_task(lease.start())
        await asyncio.sleep(0.5)
        assert not starting.done() and not lease.registered
        await asyncio.to_thread(lambda: cp_factory(port=port, **FAST))
        registration = await asyncio.wait_for(starting, 10)
        assert lease.registered and await listed(client, registration.instance_id)
        await lease.stop()
