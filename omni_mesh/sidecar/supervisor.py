"""A small local process supervisor: start children, wait until they answer, stop them all.

Each child runs in its own process group with ``PR_SET_PDEATHSIG=SIGTERM``, so a child never
outlives the supervisor, even when the supervisor is killed with SIGKILL (the signal is tied to
the thread that started the child: start children from a thread that lives as long as they
should). A child's stdout and stderr go to ``<log_dir>/<name>.log``; errors quote the tail of
that file. :meth:`Supervisor.stop` sends SIGTERM to every child (newest first), waits one grace
period, then SIGKILLs each child's whole process group and reaps it.

Blocking by design (``subprocess`` + short HTTP probes): use it from a CLI's main thread or a
synchronous test fixture, not from inside an event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]{0,63}$")
TAIL_LINES = 20


class SupervisorError(RuntimeError):
    """A supervised process failed to start, to become ready, or to stay up."""


class ChildExitedError(SupervisorError):
    """A child exited while it was expected to run."""

    def __init__(self, child: Child) -> None:
        self.name = child.name
        self.returncode = child.returncode
        self.log_tail = child.log_tail()
        super().__init__(
            f"process {child.name!r} (pid {child.pid}) {describe_exit(self.returncode)}"
            f"{_format_tail(child.log_path, self.log_tail)}"
        )


class ReadinessTimeoutError(SupervisorError):
    """A child did not answer its readiness URL with 200 in time."""

    def __init__(self, child: Child, timeout_s: float) -> None:
        self.name = child.name
        self.url = child.ready_url
        self.log_tail = child.log_tail()
        super().__init__(
            f"process {child.name!r} (pid {child.pid}) did not answer GET {child.ready_url} "
            f"with 200 within {timeout_s:g}s (raise the ready timeout if it is only slow)"
            f"{_format_tail(child.log_path, self.log_tail)}"
        )


@dataclass(eq=False)
class Child:
    """One supervised process."""

    name: str
    argv: tuple[str, ...]
    log_path: Path
    ready_url: str | None
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the child has exited (negative: killed by that signal)."""
        return self.process.poll()

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines of the child's log (decoded leniently)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                data = f.read()
        except OSError as exc:
            return f"(log unreadable: {exc})"
        text = data.decode("utf-8", errors="replace").rstrip("\n")
        return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """Starts and stops local child processes; see the module docstring.

    ``log_dir``: where logs go; by default a fresh temporary directory that :meth:`close`
    removes unless ``keep_logs``. A ``log_dir`` given by the caller is never removed.
    """

    def __init__(
        self,
        *,
        log_dir: Path | None = None,
        keep_logs: bool = False,
        grace_s: float = 10.0,
        log_prefix: str = "omni-",
    ) -> None:
        self._own_dir = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix=log_prefix)) if log_dir is None else log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.keep_logs = keep_logs
        self.grace_s = grace_s
        self._children: list[Child] = []
        self._stopping = False
        self._closed = False

    @property
    def children(self) -> tuple[Child, ...]:
        return tuple(self._children)

    # ---- start and readiness -----------------------------------------------------------------

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_url: str | None = None,
        cwd: Path | None = None,
    ) -> Child:
        """Start ``argv`` as child ``name``. ``env`` replaces the environment when given."""
        if self._stopping or self._closed:
            raise SupervisorError(f"cannot start {name!r}: the supervisor is stopping")
        if not _NAME.match(name):
            raise ValueError(f"bad process name {name!r} (letters, digits, '_', '-', '.')")
        if any(c.name == name for c in self._children):
            raise ValueError(f"a process named {name!r} is already supervised")
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                process_group=0,
                preexec_fn=_die_with_parent_hook(),
            )
        child = Child(name, tuple(argv), log_path, ready_url, process)
        self._children.append(child)
        logger.info("started process=%s pid=%d log=%s", name, process.pid, log_path)
        return child

    def wait_ready(
        self,
        children: Iterable[Child] | None = None,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> bool:
        """Block until every child (default: all with a ready URL) answers it with 200.

        Returns False when ``cancel`` is set first. Raises :class:`ChildExitedError` as soon
        as any supervised child exits, :class:`ReadinessTimeoutError` naming the first child
        still not ready at the deadline.
        """
        pending = [c for c in (self._children if children is None else children) if c.ready_url]
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while True:
            self.check()
            pending = [c for c in pending if not http_ok(c.ready_url or "")]
            if not pending:
                return True
            if time.monotonic() >= deadline:
                raise ReadinessTimeoutError(pending[0], timeout_s)
            if cancel is None:
                time.sleep(pause)
            elif cancel.wait(pause):
                return False
            pause = min(pause * 2, 0.5)

    # ---- liveness ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`ChildExitedError` for the first child that has exited."""
        if self._stopping:
            return
        for child in self._children:
            if child.returncode is not None:
                raise ChildExitedError(child)

    def wait(self, cancel: threading.Event, *, poll_s: float = 0.2) -> None:
        """Block until ``cancel`` is set; raise :class:`ChildExitedError` if a child exits."""
        while not cancel.wait(poll_s):
            self.check()

    # ---- shutdown ----------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every child (newest first), wait ``grace_s``, SIGKILL what is left, reap.

        Idempotent. Each child's whole process group is killed at the end, so grandchildren
        that a child failed to stop do not survive it either.
        """
        self._stopping = True
        children = list(reversed(self._children))
        try:
            for child in children:
                if child.returncode is None:
                    logger.info("stopping process=%s pid=%d", child.name, child.pid)
                    _signal_pid(child.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            for child in children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for child in children:
                _kill_group(child)

    def close(self) -> None:
        """Stop every child and remove the log directory unless it is kept."""
        if self._closed:
            return
        try:
            self.stop()
        finally:
            self._closed = True
            if self._own_dir and not self.keep_logs:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# ---- helpers -----------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may still take it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def port_in_use(host: str, port: int) -> bool:
    """True when binding ``host:port`` fails with EADDRINUSE-like errors."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when ``GET url`` answers 200 (no proxies, no redirects)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad readiness URL {url!r}")
    conn_cls = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout_s)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target)
        response = conn.getresponse()
        response.read()
        return response.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _format_tail(path: Path, tail: str) -> str:
    if not tail:
        return f"; its log {path} is empty"
    lines = "\n".join(f"    {line}" for line in tail.splitlines())
    return f"; last lines of {path}:\n{lines}"


def _die_with_parent_hook() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGTERM when this thread dies.

    libc is resolved here, before the fork; the hook itself only calls into it. If the parent
    is already gone when the hook runs (a race prctl cannot see), the child ends itself.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _kill_group(child: Child) -> None:
    """SIGKILL the child's process group (the child is its leader) and reap the child."""
    if child.returncode is None:
        logger.warning("process=%s pid=%d did not stop in time; killing it", child.name, child.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.process.wait()
