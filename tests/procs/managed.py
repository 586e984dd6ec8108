"""A child process of a test (:class:`ManagedProcess`): stdout/stderr in files, readiness
waits, signals, and a registry so that nothing outlives the session."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

from tests.procs.polling import clean_env, http_status, wait_until

_counter = itertools.count(1)


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
