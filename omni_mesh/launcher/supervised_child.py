"""One child of the local :class:`~omni_mesh.launcher.supervisor.Supervisor`: how it is spawned
and signalled, its log, and the restart policy (backoff, failure limits) it is kept up by.

A child runs in its own process group with ``PR_SET_PDEATHSIG=SIGTERM`` (tied to the thread
that spawned it), stdin closed, stdout and stderr appended to its log file. :class:`Child`
holds one supervised process across its restarts; the :class:`Supervisor` decides when to call
it, raises, and logs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omni_mesh.procutil import die_with_parent

TAIL_LINES = 20


@dataclass(frozen=True)
class RestartPolicy:
    """How a child that died is started again: after ``backoff_initial_s``, doubling per recent
    failure up to ``backoff_max_s``; never after ``max_failures`` failures within
    ``window_s``; a restarted child must answer its ready URL within ``ready_timeout_s``."""

    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_failures: int = 5
    window_s: float = 60.0
    ready_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if not 0 <= self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("RestartPolicy: need 0 <= backoff_initial_s <= backoff_max_s")
        if self.max_failures < 1 or self.window_s <= 0 or self.ready_timeout_s <= 0:
            raise ValueError("RestartPolicy: max_failures, window_s, ready_timeout_s must be > 0")

    def backoff_s(self, failures: int) -> float:
        """The delay before restarting a child that has failed ``failures`` times recently."""
        return min(self.backoff_max_s, self.backoff_initial_s * 2.0 ** max(0, failures - 1))


@dataclass(eq=False)
class Child:
    """One supervised process (across its restarts: ``process`` is the current one)."""

    name: str
    argv: tuple[str, ...]
    log_path: Path
    ready_url: str | None
    process: subprocess.Popen[bytes] = field(repr=False)
    env: dict[str, str] | None = field(default=None, repr=False)
    cwd: Path | None = None
    stop_rank: int = 0
    restart: RestartPolicy | None = None
    ready: bool = False  # the current process answered its ready URL (or there is none)
    ever_ready: bool = False
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    failures: deque[float] = field(default_factory=deque, repr=False)  # recent, monotonic
    unready_deaths: int = 0  # exits in a row before the process was ready
    restart_at: float | None = None  # a restart is due then (the process is dead)
    # Process groups of earlier processes (pgid, when the leader died): an engine that lost
    # its sidecar may still be cleaning up in there.
    old_groups: list[tuple[int, float]] = field(default_factory=list, repr=False)
    next_probe: float = field(default=0.0, repr=False)
    probe_ready: bool = False  # :meth:`Supervisor.check` probes its ready URL (started late)
    retiring_since: float | None = None  # removed on purpose: SIGTERM sent then (monotonic)

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

    def mark_ready(self) -> bool:
        """Record that the current process answered its ready URL; False if it already had."""
        if self.ready:
            return False
        self.ready = True
        self.ever_ready = True
        self.unready_deaths = 0
        return True

    def record_failure(self, policy: RestartPolicy, now: float) -> str | None:
        """Count the exit of the current process (at monotonic ``now``) against ``policy``.

        Returns why to give up on the child, or None once its restart is scheduled at
        :attr:`restart_at` (after the policy's backoff; the dead process group is kept in
        :attr:`old_groups` to be reaped)."""
        self.failures.append(now)
        while self.failures and self.failures[0] < now - policy.window_s:
            self.failures.popleft()
        self.unready_deaths = 0 if self.ready else self.unready_deaths + 1
        failures = len(self.failures)
        if failures >= policy.max_failures:
            return f": it failed {failures} times within {policy.window_s:g}s, giving up"
        if self.unready_deaths >= policy.max_failures:
            return (
                f": it failed {self.unready_deaths} times in a row before it was ready again,"
                " giving up"
            )
        self.restart_at = now + policy.backoff_s(failures)
        self.old_groups.append((self.pid, now))
        return None

    def respawn(self) -> None:
        """Start the same command line again, its output appended to the same log (after a
        marker line). Raises OSError when it cannot be started."""
        self.restart_at = None
        with contextlib.suppress(OSError), self.log_path.open("ab") as log:
            log.write(f"---- supervisor: restart {self.restarts + 1} ----\n".encode())
        self.process = spawn(self.argv, self.log_path, self.env, self.cwd)
        self.restarts += 1
        self.started_at = time.monotonic()
        self.ready = self.ready_url is None
        self.next_probe = 0.0


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def format_tail(path: Path, tail: str) -> str:
    if not tail:
        return f"; its log {path} is empty"
    lines = "\n".join(f"    {line}" for line in tail.splitlines())
    return f"; last lines of {path}:\n{lines}"


def signal_pid(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def spawn(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None, cwd: Path | None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a process group of its own, output appended to ``log_path``."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
            process_group=0,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )


def group_members(pgids: Iterable[int]) -> dict[int, list[int]]:
    """The running (not zombie) processes of each process group in ``pgids`` (scans /proc)."""
    wanted = set(pgids)
    out: dict[int, list[int]] = {pgid: [] for pgid in wanted}
    if not wanted:
        return out
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] not in (b"Z", b"X") and int(fields[2]) in wanted:
            out[int(fields[2])].append(int(entry.name))
    return out
