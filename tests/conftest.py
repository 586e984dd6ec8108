"""Shared fixtures: one real Redis per test session, real omni-cp processes, process cleanup.

Fixtures (see ``tests/procs.py`` for the helpers behind them):

- ``redis_server`` (session): a :class:`~tests.procs.RedisServer` started once.
- ``redis_url`` : the session Redis, FLUSHALL'd before the test; its URL.
- ``redis_client`` (async): a ``redis.asyncio.Redis`` (decode_responses) on the flushed Redis.
- ``private_redis_factory``: ``make() -> RedisServer`` for tests that kill or restart Redis.
- ``process_factory``: ``make(argv, name=..., env=...) -> ManagedProcess`` (started), killed
  at teardown.
- ``cp_factory``: ``make(redis_url=..., **start_control_plane kwargs) -> ControlPlaneProcess``;
  ``redis_url`` defaults to the (already flushed) session Redis; all stopped at teardown.
- ``control_plane``: one omni-cp with default timings on the flushed session Redis.

Whatever a test leaves running is killed at its teardown, and again at the end of the session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from tests.procs import (
    ControlPlaneProcess,
    ManagedProcess,
    RedisServer,
    orphaned_shm_segments,
    start_control_plane,
)


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """After the whole suite: no process a test started is still running, and no
    shared-memory segment was leaked (whatever is found is also cleaned up)."""
    before = orphaned_shm_segments()
    yield
    running = ManagedProcess.still_running()
    ManagedProcess.kill_all()
    leaked = orphaned_shm_segments() - before
    for name in leaked:
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert not running, f"tests left processes running: {running}"
    assert not leaked, f"tests leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(log_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    if redis_server.proc is None or not redis_server.proc.alive:  # a test killed it
        redis_server.start()
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def private_redis_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        server = RedisServer(log_dir=tmp_path / f"redis-{len(servers)}")
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.kill()


@pytest.fixture
def process_factory(tmp_path: Path) -> Iterator[Callable[..., ManagedProcess]]:
    procs: list[ManagedProcess] = []

    def make(argv: Sequence[str], **kwargs: Any) -> ManagedProcess:
        kwargs.setdefault("log_dir", tmp_path / "procs")
        proc = ManagedProcess(argv, **kwargs).start()
        procs.append(proc)
        return proc

    yield make
    for proc in procs:
        proc.cleanup()


@pytest.fixture
def cp_factory(
    redis_server: RedisServer, tmp_path: Path
) -> Iterator[Callable[..., ControlPlaneProcess]]:
    started: list[ControlPlaneProcess] = []
    flushed = False

    def make(**kwargs: Any) -> ControlPlaneProcess:
        nonlocal flushed
        if "redis_url" not in kwargs:
            if not flushed:
                redis_server.flushall()
                flushed = True
            kwargs["redis_url"] = redis_server.url
        kwargs.setdefault("log_dir", tmp_path / "procs")
        cp = start_control_plane(**kwargs)
        started.append(cp)
        return cp

    yield make
    for cp in started:
        cp.proc.cleanup()


@pytest.fixture
def control_plane(cp_factory: Callable[..., ControlPlaneProcess]) -> ControlPlaneProcess:
    return cp_factory()
