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

Whatever a test leaves running is killed at its teardown, and again at the end of the session;
a shared-memory segment leaked by any test fails the run. ``make test`` runs two pytest-xdist
workers (where there are two cores); the tests that must share one are grouped below.
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
def _nothing_left_running() -> Iterator[None]:
    """After this process's tests: no process they started is still running."""
    yield
    running = ManagedProcess.still_running()
    ManagedProcess.kill_all()
    assert not running, f"tests left processes running: {running}"


# ---- the whole run: no shared memory leaked -----------------------------------------------------
# Checked once, by the process that runs the session: with pytest-xdist the controller, after
# every worker ended (a worker's own check would see the other's segments between a kill and its
# sweep).

_SHM_BEFORE = pytest.StashKey[set[str]]()


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_worker(session.config):
        session.config.stash[_SHM_BEFORE] = orphaned_shm_segments()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _is_worker(session.config) or _SHM_BEFORE not in session.config.stash:
        return
    leaked = orphaned_shm_segments() - session.config.stash[_SHM_BEFORE]
    for name in leaked:  # cleaned up, and the run fails
        Path("/dev/shm", name).unlink(missing_ok=True)
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"tests leaked shared-memory segments: {sorted(leaked)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---- two workers (pytest-xdist: `make test`) ----------------------------------------------------
#: Folders whose tests run in one worker: they share a deployment started once per worker (a
#: session or package fixture: tiny-llm, the qwen3-omni topology, the multi-host fabric). Every
#: other test file is a unit of its own (its module fixtures, and tests that build on the one
#: before, stay together). Test hosts of two workers coexist (tests/multihost/hosts.py: owners).
FOLDER_GROUPS = {
    "tests/engines/vllm": "vllm",
    "tests/engines/qwen3_omni": "qwen3-omni",
    "tests/multihost": "hosts",
}


def work_unit(nodeid: str) -> str:
    """The unit of work of a test under ``--dist loadgroup``: its folder's group, or its file."""
    path = nodeid.split("::", 1)[0]
    for folder, group in FOLDER_GROUPS.items():
        if path.startswith(folder + "/"):
            return group
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` as :func:`work_unit` says, from each test's node id. (xdist's own
    loadgroup reads ``xdist_group`` marks into a suffix of the node id, which pytest 9.2's
    node ids no longer take: every test was a unit of its own, the shared deployments started
    on both workers and a module's tests split between them.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return GroupScheduling(config, log)


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
