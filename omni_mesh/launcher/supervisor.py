"""A small local process supervisor: start children, wait until they answer, restart the ones
that die, stop them all in order.

Each child runs in its own process group with ``PR_SET_PDEATHSIG=SIGTERM``, so a child never
outlives the supervisor, even when the supervisor is killed with SIGKILL. The signal is tied to
the thread that started the child, and :meth:`Supervisor.check` (so :meth:`~Supervisor.wait`
and :meth:`~Supervisor.wait_ready`) starts restarted children: call them all from one thread
that lives as long as the children should. A child's stdout and stderr go to
``<log_dir>/<name>.log`` (a restart appends to it); errors quote the tail of that file.

**Restarts.** A child started with a :class:`RestartPolicy` that exits while the supervisor is
not stopping is started again with the same command line (so on the same port) after an
exponential backoff. The supervisor gives up (:meth:`~Supervisor.check` raises) when such a
child exits before it was ever ready, fails ``max_failures`` times within ``window_s`` (or that
many times in a row before it is ready again), or does not answer its ready URL again within
``ready_timeout_s``. A child without a policy that exits is an error at once.

**Stopping** (:meth:`Supervisor.stop`). Children stop in ascending ``stop_rank``: the children
of one rank together, a rank only once the ranks before it are gone. A child gets SIGTERM (its
own pid: a stage pod drains, then stops its engine itself) and ``grace_s`` to exit, then
SIGKILL; what is left of its process group ``reap_s`` later is SIGKILLed as a group (the
:class:`~omni_mesh.launcher.reaper.Reaper`). Every SIGKILL is recorded in
:attr:`Supervisor.killed`.

**Removing one child on purpose** (:meth:`Supervisor.retire`, the autoscaler's scale-down):
it gets SIGTERM (a stage pod drains: it leaves its pool, finishes its work, exits 0), is never
restarted, and leaves :attr:`Supervisor.children` once it has exited; one still running
``grace_s`` after the SIGTERM is SIGKILLed (and recorded). A child started with ``probe=True``
(after the first :meth:`~Supervisor.wait_ready`) has its ready URL probed by
:meth:`~Supervisor.check` instead of waited on.

Blocking by design (``subprocess`` + short HTTP probes): use it from a CLI's main thread or a
synchronous test fixture, not from inside an event loop.

One child's process handling (spawning, signalling, its log, the restart bookkeeping) lives in
:mod:`omni_mesh.launcher.supervised_child`, signalling children to their end and clearing
their process groups in :mod:`omni_mesh.launcher.reaper`, the port and HTTP checks in
:mod:`omni_mesh.launcher.local_net`; their public names are re-exported here.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from omni_mesh.launcher.local_net import http_ok, port_in_use
from omni_mesh.launcher.reaper import Reaper
from omni_mesh.launcher.supervised_child import (
    TAIL_LINES,
    Child,
    RestartPolicy,
    describe_exit,
    format_tail,
    group_members,
    signal_pid,
    spawn,
)
from omni_mesh.procutil import free_port

__all__ = [
    "TAIL_LINES",
    "Child",
    "ChildExitedError",
    "ReadinessTimeoutError",
    "RestartLimitError",
    "RestartPolicy",
    "Supervisor",
    "SupervisorError",
    "describe_exit",
    "free_port",
    "group_members",
    "http_ok",
    "port_in_use",
]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]{0,63}$")
_PROBE_INTERVAL_S = 0.25  # readiness probes of a restarted child
_POLL_S = 0.05  # readiness polls, at first


class SupervisorError(RuntimeError):
    """A supervised process failed to start, to become ready, or to stay up."""


class ChildExitedError(SupervisorError):
    """A child exited while it was expected to run (and is not going to be restarted)."""

    def __init__(self, child: Child, detail: str = "") -> None:
        self.name = child.name
        self.returncode = child.returncode
        self.log_tail = child.log_tail()
        super().__init__(
            f"process {child.name!r} (pid {child.pid}) {describe_exit(self.returncode)}{detail}"
            f"{format_tail(child.log_path, self.log_tail)}"
        )


class RestartLimitError(ChildExitedError):
    """A child with a restart policy failed too often to go on restarting it."""


class ReadinessTimeoutError(SupervisorError):
    """A child did not answer its readiness URL with 200 in time."""

    def __init__(self, child: Child, timeout_s: float) -> None:
        self.name = child.name
        self.url = child.ready_url
        self.log_tail = child.log_tail()
        super().__init__(
            f"process {child.name!r} (pid {child.pid}) did not answer GET {child.ready_url} "
            f"with 200 within {timeout_s:g}s (raise the ready timeout if it is only slow)"
            f"{format_tail(child.log_path, self.log_tail)}"
        )


class Supervisor:
    """Starts, restarts and stops local child processes; see the module docstring.

    ``log_dir``: where logs go; by default a fresh temporary directory that :meth:`close`
    removes unless ``keep_logs``. A ``log_dir`` given by the caller is never removed.
    ``grace_s``: how long a child has to exit after SIGTERM; ``reap_s``: how long what is left
    of a dead child's process group has to exit before it is SIGKILLed.
    """

    def __init__(
        self,
        *,
        log_dir: Path | None = None,
        keep_logs: bool = False,
        grace_s: float = 10.0,
        reap_s: float = 3.0,
        log_prefix: str = "omni-",
    ) -> None:
        self._own_dir = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix=log_prefix)) if log_dir is None else log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.keep_logs = keep_logs
        self._reaper = Reaper(grace_s=grace_s, reap_s=reap_s)
        self._children: list[Child] = []
        self._retired: list[Child] = []  # retired and gone, their process groups not yet reaped
        self._stopping = False
        self._stopped = False
        self._closed = False

    @property
    def children(self) -> tuple[Child, ...]:
        return tuple(self._children)

    @property
    def grace_s(self) -> float:
        return self._reaper.grace_s

    @property
    def reap_s(self) -> float:
        return self._reaper.reap_s

    @property
    def killed(self) -> list[str]:
        """What had to be SIGKILLed, and why."""
        return self._reaper.killed

    # ---- start and readiness -----------------------------------------------------------------

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_url: str | None = None,
        cwd: Path | None = None,
        stop_rank: int = 0,
        restart: RestartPolicy | None = None,
        probe: bool = False,
    ) -> Child:
        """Start ``argv`` as child ``name``. ``env`` replaces the environment when given.

        ``stop_rank``: children stop in ascending rank (equal ranks together). ``restart``:
        restart the child when it dies (see the module docstring); without, its exit is an
        error. ``probe``: :meth:`check` probes the ready URL (within the restart policy's
        ``ready_timeout_s``) rather than the caller waiting with :meth:`wait_ready`."""
        if self._stopping or self._closed:
            raise SupervisorError(f"cannot start {name!r}: the supervisor is stopping")
        if not _NAME.match(name):
            raise ValueError(f"bad process name {name!r} (letters, digits, '_', '-', '.')")
        if any(c.name == name for c in self._children):
            raise ValueError(f"a process named {name!r} is already supervised")
        log_path = self.log_dir / f"{name}.log"
        child_env = None if env is None else dict(env)
        process = spawn(argv, log_path, child_env, cwd)
        child = Child(
            name,
            tuple(argv),
            log_path,
            ready_url,
            process,
            env=child_env,
            cwd=cwd,
            stop_rank=stop_rank,
            restart=restart,
            ready=ready_url is None,
            ever_ready=ready_url is None,
            probe_ready=probe,
        )
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

        Returns False when ``cancel`` is set first. Meanwhile :meth:`check` runs: it raises
        :class:`ChildExitedError` as soon as a child that was never ready exits (or one
        without a restart policy). Raises :class:`ReadinessTimeoutError` naming the first child
        still not ready at the deadline.
        """
        pending = [c for c in (self._children if children is None else children) if c.ready_url]
        deadline = time.monotonic() + timeout_s
        pause = _POLL_S
        while True:
            self.check()
            still = []
            for child in pending:
                if child.ready or (child.returncode is None and http_ok(child.ready_url or "")):
                    self._mark_ready(child)
                else:
                    still.append(child)
            pending = still
            if not pending:
                return True
            if time.monotonic() >= deadline:
                raise ReadinessTimeoutError(pending[0], timeout_s)
            if cancel is None:
                time.sleep(pause)
            elif cancel.wait(pause):
                return False
            pause = min(pause * 2, 0.5)

    def _mark_ready(self, child: Child) -> None:
        if not child.mark_ready():
            return
        if child.restarts:
            logger.warning(
                "process=%s pid=%d is ready again (restart %d)",
                child.name,
                child.pid,
                child.restarts,
            )
        elif child.probe_ready:
            logger.info(
                "process=%s pid=%d is ready %.2fs after its start",
                child.name,
                child.pid,
                time.monotonic() - child.started_at,
            )

    # ---- liveness and restarts ---------------------------------------------------------------

    def check(self) -> None:
        """Handle children that exited: schedule and do the restarts of those with a restart
        policy, raise :class:`ChildExitedError` (or :class:`RestartLimitError`,
        :class:`ReadinessTimeoutError`) for the first one the supervisor gives up on."""
        if self._stopping:
            return
        now = time.monotonic()
        for child in list(self._children):
            if child.retiring_since is not None:
                self._check_retiring(child, now)
            elif child.restart_at is not None:
                if now >= child.restart_at:
                    self._respawn(child)
            elif child.returncode is not None:
                self._exited(child, now)
            elif not child.ready and (child.restarts or child.probe_ready):
                self._probe_restarted(child, now)
        self._reap_old_groups(now)

    def retire(self, child: Child, why: str) -> None:
        """Remove ``child`` on purpose: SIGTERM now (a pod drains), no restart; it leaves
        :attr:`children` once it has exited (see :meth:`check`)."""
        if child.retiring_since is not None or child not in self._children:
            return
        child.retiring_since = time.monotonic()
        child.restart = None
        if child.restart_at is not None or child.returncode is not None:
            child.restart_at = None  # dead, waiting for a restart: nothing to drain
            logger.info("retiring process=%s (not running): %s", child.name, why)
            return
        logger.info("retiring process=%s pid=%d (SIGTERM, drain): %s", child.name, child.pid, why)
        signal_pid(child.pid, signal.SIGTERM)

    def _check_retiring(self, child: Child, now: float) -> None:
        code = child.returncode
        if code is None:
            if now - (child.retiring_since or now) > self.grace_s:
                self._reaper.kill_child(child, f"did not exit within {self.grace_s:g}s of SIGTERM")
            return
        level = logging.INFO if code == 0 else logging.WARNING
        logger.log(level, "retired process=%s pid=%d %s", child.name, child.pid,
                   describe_exit(code))  # fmt: skip
        self._children.remove(child)
        child.old_groups.append((child.pid, now))  # its engine may still be cleaning up
        self._retired.append(child)

    def wait(self, cancel: threading.Event, *, poll_s: float = 0.2) -> None:
        """Block until ``cancel`` is set, restarting children that die (see :meth:`check`,
        which raises when the supervisor gives up on one)."""
        while not cancel.wait(poll_s):
            self.check()

    def _exited(self, child: Child, now: float) -> None:
        policy = child.restart
        if policy is None:
            raise ChildExitedError(child)
        if not child.ever_ready:
            raise ChildExitedError(child, " before it was ever ready (not restarting it)")
        give_up = child.record_failure(policy, now)
        if give_up is not None:
            raise RestartLimitError(child, give_up)
        delay = policy.backoff_s(len(child.failures))
        logger.warning(
            "process=%s pid=%d %s; restarting it in %.1fs (failure %d within %gs)",
            child.name,
            child.pid,
            describe_exit(child.returncode),
            delay,
            len(child.failures),
            policy.window_s,
        )

    def _respawn(self, child: Child) -> None:
        try:
            child.respawn()
        except OSError as exc:
            raise SupervisorError(f"cannot restart process {child.name!r}: {exc}") from exc
        logger.warning(
            "restarted process=%s pid=%d (restart %d)", child.name, child.pid, child.restarts
        )

    def _probe_restarted(self, child: Child, now: float) -> None:
        if now < child.next_probe or child.ready_url is None or child.restart is None:
            return
        child.next_probe = now + _PROBE_INTERVAL_S
        if http_ok(child.ready_url, timeout_s=0.5):
            self._mark_ready(child)
        elif now - child.started_at > child.restart.ready_timeout_s:
            raise ReadinessTimeoutError(child, child.restart.ready_timeout_s)

    def _reap_old_groups(self, now: float) -> None:
        """SIGKILL what is left of a dead child's process group ``reap_s`` after it died."""
        due = [
            (child, pgid)
            for child in (*self._children, *self._retired)
            for pgid, died in child.old_groups
            if now - died >= self.reap_s
        ]
        for child, pgid in due:
            child.old_groups = [g for g in child.old_groups if g[0] != pgid]
        self._retired = [c for c in self._retired if c.old_groups]
        if due:
            self._reaper.kill_leftovers(due, wait_s=0.0)

    # ---- shutdown ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every child, rank by rank (see the module docstring); idempotent.

        Interrupted (a second Ctrl-C: KeyboardInterrupt), it SIGKILLs everything left at once
        and re-raises."""
        if self._stopped:
            return
        self._stopping = True
        try:
            for rank in sorted({c.stop_rank for c in self._children}):
                self._reaper.stop_rank([c for c in self._children if c.stop_rank == rank])
            retired = [(c, pgid) for c in self._retired for pgid, _ in c.old_groups]
            self._retired = []
            self._reaper.kill_leftovers(retired, wait_s=self.reap_s)
        except BaseException:
            self._reaper.kill_all(self._children)
            raise
        finally:
            self._stopped = True

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
