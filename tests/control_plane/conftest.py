"""Fixtures of the control-plane tests: a fast-ticking omni-cp shared by a module, clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from omni_mesh.control_plane.client import ControlPlaneClient
from tests.procs import ControlPlaneProcess, RedisServer, start_control_plane

# Timings of the shared omni-cp: short leases so expiry tests take about a second.
FAST_HEARTBEAT_MS = 200
FAST_LEASE_MS = 1000
FAST_SWEEP_MS = 100


@pytest.fixture(scope="module")
def fast_cp(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlaneProcess]:
    """One omni-cp (lease 1 s, sweep 100 ms) on the session Redis, shared by a test module.

    Tests sharing it must not depend on an empty Redis: they use their own addresses.
    """
    if redis_server.proc is None or not redis_server.proc.alive:
        redis_server.start()
    redis_server.flushall()
    cp = start_control_plane(
        redis_server.url,
        heartbeat_interval_ms=FAST_HEARTBEAT_MS,
        lease_ttl_ms=FAST_LEASE_MS,
        sweep_interval_ms=FAST_SWEEP_MS,
        extra_args=["--sweeper-lock-ttl-ms", "1000"],
        log_dir=tmp_path_factory.mktemp("fast-cp"),
        name="omni-cp-fast",
    )
    yield cp
    cp.proc.cleanup()


@pytest.fixture
async def fast_client(fast_cp: ControlPlaneProcess) -> AsyncIterator[ControlPlaneClient]:
    client = ControlPlaneClient([fast_cp.url], timeout_s=5.0)
    yield client
    await client.close()
