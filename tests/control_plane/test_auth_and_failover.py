"""Bearer-token auth, and two omni-cp on one Redis: the sweeper survives a kill -9 of its holder."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import aiohttp
import pytest

from omni_mesh.control_plane.client import (
    ControlPlaneAuthError,
    ControlPlaneClient,
    InstanceState,
    RegisterRequest,
)
from tests.procs import ControlPlaneProcess, RedisServer, http_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

TOKEN = "t0ps3cret"

REQUEST = RegisterRequest(
    pipeline="tiny-omni", stage_id=0, address="http://127.0.0.1:9500", capacity=2
)


async def test_auth_required_except_healthz_and_metrics(
    cp_factory: Callable[..., ControlPlaneProcess],
) -> None:
    cp = cp_factory(auth_token=TOKEN)
    assert http_status(f"{cp.url}/healthz") == 200
    assert http_status(f"{cp.url}/metrics") == 200
    async with aiohttp.ClientSession(base_url=cp.url) as session:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            async with session.get("/v1/pipelines", headers=headers) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                error = (await resp.json())["error"]
                assert error["param"] == "Authorization"
                assert "token" in error["message"]
        async with session.post("/v1/instances", data=b"{") as resp:
            assert resp.status == 401, "auth is checked before the body"
        async with session.get("/v1/pipelines", headers=cp.auth_headers) as resp:
            assert resp.status == 200

    async with ControlPlaneClient([cp.url], auth_token="wrong") as bad:
        with pytest.raises(ControlPlaneAuthError):
            await bad.register(REQUEST)
    async with ControlPlaneClient([cp.url], auth_token=TOKEN) as good:
        registration = await good.register(REQUEST)
        assert (await good.instances("tiny-omni", 0)).instances[0].instance_id == (
            registration.instance_id
        )


def _is_leader(cp: ControlPlaneProcess) -> bool:
    import urllib.request

    with urllib.request.urlopen(f"{cp.url}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    match = re.search(r"^omni_cp_sweeper_leader (\S+)$", text, re.M)
    return match is not None and float(match.group(1)) == 1.0


async def test_kill_9_of_the_sweeper_holder_hands_over_expiry(
    cp_factory: Callable[..., ControlPlaneProcess],
) -> None:
    timings = {"heartbeat_interval_ms": 200, "lease_ttl_ms": 1000, "sweep_interval_ms": 100}
    lock_ttl_s = 1.0
    extra = ["--sweeper-lock-ttl-ms", str(int(lock_ttl_s * 1000))]
    first = cp_factory(name="omni-cp-a", extra_args=extra, **timings)
    await asyncio.sleep(0.3)
    second = cp_factory(name="omni-cp-b", extra_args=extra, **timings)
    await asyncio.sleep(0.3)
    leaders = [cp for cp in (first, second) if _is_leader(cp)]
    assert len(leaders) == 1, "exactly one omni-cp sweeps"
    holder = leaders[0]
    survivor = second if holder is first else first

    async with ControlPlaneClient([survivor.url]) as client:
        registration = await client.register(REQUEST)
        holder.kill()  # kill -9: the lock is not released, it has to expire
        killed_at = time.monotonic()
        budget = 1.0 + lock_ttl_s + 1.5  # lease + lock expiry + ticks and slack
        while True:
            pool = await client.instances("tiny-omni", 0, all=True)
            [info] = [i for i in pool.instances if i.instance_id == registration.instance_id]
            if info.state is InstanceState.ISOLATED:
                break
            assert time.monotonic() - killed_at < budget, "no omni-cp took over the sweeper"
            await asyncio.sleep(0.05)
        assert info.reason == "lease_expired"
        assert _is_leader(survivor)


async def test_redis_outage_is_a_503_and_recovers(
    cp_factory: Callable[..., ControlPlaneProcess],
    private_redis_factory: Callable[[], RedisServer],
) -> None:
    redis_server = private_redis_factory()
    cp = cp_factory(redis_url=redis_server.url)
    await asyncio.to_thread(redis_server.kill)
    async with aiohttp.ClientSession(base_url=cp.url) as session:
        started = time.monotonic()
        async with session.post("/v1/instances", data=REQUEST.model_dump_json()) as resp:
            assert resp.status == 503
            assert "redis" in (await resp.json())["error"]["message"]
            assert resp.headers["Retry-After"] == "1"
        assert time.monotonic() - started < 3.0, "a Redis outage must fail fast"
        for path in ("/v1/pipelines", "/v1/watch?pipeline=tiny-omni", "/healthz"):
            async with session.get(path) as resp:
                assert resp.status == 503, path
        async with session.get("/metrics") as resp:
            assert resp.status == 200, "metrics stay available without Redis"
        for _ in range(20):  # a health probe polling during the outage
            async with session.get("/healthz") as resp:
                assert resp.status == 503
        # the warnings are rate-limited (one per 5 s, with a count), not one per request
        assert cp.proc.stderr.count("redis unavailable") <= 2, cp.proc.stderr

        await asyncio.to_thread(redis_server.start)
        async with ControlPlaneClient([cp.url]) as client:
            registration = await client.register(REQUEST)
            assert registration.instance_id
            # the change subscription comes back too: a watcher is woken by the next change
            await asyncio.sleep(2.5)  # > the hub's reconnect backoff cap
            current = await client.watch("tiny-omni", None, timeout_s=0)
            waiter = asyncio.create_task(client.watch("tiny-omni", current.version, timeout_s=20))
            await asyncio.sleep(0.2)
            changed_at = time.monotonic()
            await client.deregister(registration.instance_id)
            assert (await waiter).version != current.version
            assert time.monotonic() - changed_at < 1.0, "woken by the notification, not a recheck"
        async with session.get("/healthz") as resp:
            assert resp.status == 200
    assert "Traceback" not in cp.proc.stderr
