"""In-process tests of omni-cp's failure handling: the error middleware's catch-all, rate-limited
"Redis unavailable" logs, the embedded-Redis supervisor and launcher, stale-directory sweeping,
and the client's human-readable transport errors."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from omni_mesh.control_plane.api.logthrottle import ThrottledLog
from omni_mesh.control_plane.api.middleware import error_middleware
from omni_mesh.control_plane.cli import url_problem
from omni_mesh.control_plane.client import ControlPlaneClient, ControlPlaneUnavailableError
from omni_mesh.control_plane.client.http import describe_transport_error
from omni_mesh.control_plane.embedded_redis import (
    EmbeddedRedis,
    EmbeddedRedisError,
    find_redis_server,
    sweep_stale_dirs,
)
from omni_mesh.control_plane.errors import EndpointFailure
from omni_mesh.control_plane.server import ServeError, supervise_embedded_redis
from tests.procs import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# ---- the error middleware ------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[TestClient]]]:
    clients: list[TestClient] = []

    async def make(handler: Handler) -> TestClient:
        app = web.Application(middlewares=[error_middleware])
        app.router.add_route("*", "/x", handler)
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def test_a_bug_is_a_logged_json_500(
    serve: Callable[[Handler], Awaitable[TestClient]], caplog: pytest.LogCaptureFixture
) -> None:
    async def buggy(request: web.Request) -> web.Response:
        raise ZeroDivisionError("oops")

    client = await serve(buggy)
    with caplog.at_level(logging.ERROR, logger="omni_mesh.control_plane.api.middleware"):
        resp = await client.post("/x", data=b"{}")
        assert resp.status == 500
        assert resp.content_type == "application/json"
        assert await resp.json() == {
            "error": {
                "message": "internal error (see omni-cp logs)",
                "type": "internal_error",
                "param": None,
                "code": 500,
            }
        }
    [record] = [r for r in caplog.records if "unhandled error" in r.getMessage()]
    assert record.getMessage() == "unhandled error: POST /x"
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError


async def test_a_payload_error_outside_read_model_is_a_400(
    serve: Callable[[Handler], Awaitable[TestClient]],
) -> None:
    async def reads_itself(request: web.Request) -> web.Response:
        try:
            raise ValueError("Can not decode content-encoding: gzip")
        except ValueError as cause:
            raise web.RequestPayloadError("400, message: bad") from cause

    client = await serve(reads_itself)
    resp = await client.post("/x", data=b"xxxx")
    assert resp.status == 400
    assert await resp.json() == {
        "error": {
            "message": "request body could not be read: Can not decode content-encoding: gzip",
            "type": "invalid_request_error",
            "param": "body",
            "code": 400,
        }
    }
    assert resp.headers["Connection"] == "close"


async def test_a_client_that_went_away_is_not_a_500(
    serve: Callable[[Handler], Awaitable[TestClient]], caplog: pytest.LogCaptureFixture
) -> None:
    async def gone(request: web.Request) -> web.Response:
        raise ConnectionResetError("Connection lost")

    client = await serve(gone)
    with caplog.at_level(logging.DEBUG):
        resp = await client.get("/x")
        assert resp.status == 499
        assert (await resp.json())["error"]["message"] == "client closed the connection"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---- rate-limited warnings -----------------------------------------------------------------


def test_throttled_log_counts_what_it_holds_back(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = ThrottledLog(logging.getLogger("test.throttle"), 5.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        assert log("redis unavailable: %s", "e1")
        for i in range(29):  # ~6 a second for 5 s
            now[0] += 0.166
            assert not log("redis unavailable: %s", f"e{i + 2}")
        now[0] = 105.1
        assert log("redis unavailable: %s", "e31")
        now[0] = 111.0
        assert log("redis unavailable: %s", "e32")
    assert [r.getMessage() for r in caplog.records] == [
        "redis unavailable: e1",
        "redis unavailable: e31 (and 29 similar in the last 5s)",
        "redis unavailable: e32",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


# ---- the embedded-Redis supervisor ---------------------------------------------------------


class FakeRedis:
    """Stands in for EmbeddedRedis in the supervisor: dies on demand, restarts or fails to."""

    def __init__(self) -> None:
        self.alive = True
        self.pid: int | None = 1000
        self.port = 6399
        self.returncode: int | None = None
        self.restarts = 0
        self.fail_restarts = 0

    def die(self) -> None:
        self.alive, self.returncode = False, -signal.SIGKILL

    def exit_status(self) -> str:
        return "killed by SIGKILL"

    def log_tail(self) -> str:
        return "(log)"

    async def restart(self) -> str:
        self.restarts += 1
        if self.fail_restarts:
            self.fail_restarts -= 1
            self.alive, self.pid = False, None
            raise EmbeddedRedisError("port taken")
        self.alive, self.pid, self.returncode = True, 1000 + self.restarts, None
        return "redis://127.0.0.1:6399/0"


async def _until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(2.0):
        while not predicate():  # noqa: ASYNC110  # polls a fake / a process, no event to await
            await asyncio.sleep(0.01)


async def test_supervisor_restarts_then_gives_up(caplog: pytest.LogCaptureFixture) -> None:
    fake, stop = FakeRedis(), asyncio.Event()
    task = asyncio.create_task(
        supervise_embedded_redis(fake, stop, limit=3, window_s=30, interval_s=0.01)  # type: ignore[arg-type]
    )
    with caplog.at_level(logging.ERROR, logger="omni_mesh.control_plane.server"):
        for n in (1, 2):
            fake.die()
            await _until(lambda n=n: fake.restarts == n and fake.alive)  # type: ignore[misc]
        fake.die()
        with pytest.raises(ServeError, match="died 3 times within 30s: giving up"):
            await asyncio.wait_for(task, 2)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(
        "embedded redis-server pid=1000 died unexpectedly (killed by SIGKILL); "
        "restarting it empty on port 6399 (1/3 deaths within 30s)"
    )
    assert "pid=1001" in messages[1] and "(2/3 deaths" in messages[1]
    assert all(r.levelno == logging.ERROR for r in caplog.records)


async def test_supervisor_forgets_old_deaths_and_counts_failed_restarts() -> None:
    fake, stop = FakeRedis(), asyncio.Event()
    task = asyncio.create_task(
        supervise_embedded_redis(fake, stop, limit=3, window_s=0.3, interval_s=0.01)  # type: ignore[arg-type]
    )
    for n in (1, 2, 3, 4):  # never 3 deaths within 0.3 s: it never gives up
        fake.die()
        await _until(lambda n=n: fake.restarts == n and fake.alive)  # type: ignore[misc]
        await asyncio.sleep(0.2)
    assert not task.done()
    fake.fail_restarts = 5  # a restart that fails is one more death, then another try
    fake.die()
    with pytest.raises(ServeError, match="is not running \\(its restart failed\\)"):
        await asyncio.wait_for(task, 2)
    assert fake.restarts == 5  # 4 that worked, 1 that failed


async def test_supervisor_stops_quietly() -> None:
    fake, stop = FakeRedis(), asyncio.Event()
    task = asyncio.create_task(supervise_embedded_redis(fake, stop, interval_s=0.01))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    stop.set()
    fake.die()  # redis going down with omni-cp is not a death to act on
    await asyncio.wait_for(task, 1)
    assert fake.restarts == 0


# ---- the embedded-Redis launcher -----------------------------------------------------------


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_sweep_removes_only_directories_of_dead_owners(tmp_path: Path) -> None:
    dead, alive = _dead_pid(), os.getpid()
    names = {
        f"omni-cp-redis-{dead}-a1": None,
        f"omni-cp-redis-{alive}-b2": None,
        "omni-cp-redis-legacy1": f"{dead}:C 29 Nov 2026 11:45:21.150 # Redis is starting\n",
        "omni-cp-redis-legacy2": f"{alive}:M 29 Nov 2026 11:45:21.150 * Ready\n",
        "omni-cp-redis-nolog": None,  # no owner to tell: kept
        "unrelated": None,
    }
    for name, log in names.items():
        (tmp_path / name).mkdir()
        if log is not None:
            (tmp_path / name / "redis.log").write_text(log)
    (tmp_path / "omni-cp-redis-file").write_text("not a directory")
    removed = sweep_stale_dirs(tmp_path)
    assert sorted(p.name for p in removed) == [f"omni-cp-redis-{dead}-a1", "omni-cp-redis-legacy1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [
            f"omni-cp-redis-{alive}-b2",
            "omni-cp-redis-legacy2",
            "omni-cp-redis-nolog",
            "unrelated",
            "omni-cp-redis-file",
        ]
    )


def test_a_redis_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "fake-redis-server"
    script.write_text("#!/bin/sh\necho 'FATAL: cannot start: bad config' \nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(EmbeddedRedisError, match=r"exit code 3\): FATAL: cannot start"):
        EmbeddedRedis(executable=str(script), startup_timeout_s=2).start()


@pytest.mark.integration
async def test_embedded_redis_restarts_on_its_port_and_leaves_nothing_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        find_redis_server()
    except EmbeddedRedisError:
        pytest.skip("no redis-server")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    embedded = EmbeddedRedis()
    try:
        url = embedded.start()
        assert _entries(tmp_path) == []
        first = embedded.pid
        assert first is not None and embedded.alive
        os.kill(first, signal.SIGKILL)
        await _until(lambda: not embedded.alive)
        assert embedded.exit_status() == "killed by SIGKILL"
        assert "Ready to accept connections" in embedded.log_tail()
        assert await embedded.restart() == url
        assert embedded.alive and embedded.pid != first
        assert _entries(tmp_path) == []
    finally:
        embedded.stop()
    assert not embedded.alive


# ---- the client's transport errors ---------------------------------------------------------


async def test_unavailable_error_says_what_happened_without_reprs() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with ControlPlaneClient([url], timeout_s=1.0) as client:
        with pytest.raises(ControlPlaneUnavailableError) as info:
            await client.pipelines()
    error = info.value
    assert error.failures == (EndpointFailure(url, "connection refused"),)
    assert error.describe() == f"cannot reach the control plane at {url}: connection refused"
    assert str(error) == (
        f"GET /v1/pipelines: no control plane answered ({url}: connection refused)"
    )
    assert "ConnectionKey" not in str(error)


def test_endpoint_failure_with_an_answer() -> None:
    failure = EndpointFailure("http://cp:7700", "storage unavailable", 503)
    assert failure.describe() == (
        "the control plane at http://cp:7700 answered HTTP 503: storage unavailable"
    )


@pytest.mark.parametrize(
    ("exc", "text"),
    [
        (TimeoutError(), "no answer within 2s"),
        (aiohttp.ServerDisconnectedError(), "the server closed the connection without answering"),
        (ConnectionResetError(104, "Connection reset by peer"), "connection reset"),
        (aiohttp.ClientPayloadError("x"), "the answer was cut short"),
        (RuntimeError("weird"), "RuntimeError: weird"),
    ],
)
def test_describe_transport_error(exc: BaseException, text: str) -> None:
    assert describe_transport_error(exc, 2.0) == text


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:7700", None),
        ("https://cp.example.com", None),
        ("http://[::1]:7700/", None),
        ("htp:/foo", "expected http://HOST:PORT"),
        ("localhost:7700", "expected http://HOST:PORT"),
        ("http://", "no host"),
        ("http://:7700", "no host"),
        ("http://h:99999", "out of range"),
        ("http://h:port", "expected http://HOST:PORT"),
        ("http://u:p@h:1", "without credentials"),
        ("http://h:1/?x=1", "without credentials, query"),
    ],
)
def test_url_problem(url: str, problem: str | None) -> None:
    found = url_problem(url)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found
