"""Ending the local supervisor's children for good: SIGTERM a rank of children and wait out
their grace, SIGKILL the ones still running, then empty what is left of their process groups.

A child that ignores SIGTERM for ``grace_s`` gets SIGKILL to its own pid only, so that what it
started (an engine, which then gets PDEATHSIG or EOF) can still clean up; whatever of a process
group is still running ``reap_s`` after its leader died is SIGKILLed as a group. Every SIGKILL
is recorded in :attr:`Reaper.killed` with the reason. When to call these (ranks, retirements,
an interrupted stop) is :class:`~omni_mesh.launcher.supervisor.Supervisor`'s job.

Blocking by design, like the supervisor: call it from the supervisor's thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time

from omni_mesh.launcher.supervised_child import Child, group_members, signal_pid

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_GONE_S = 2.0  # how long a SIGKILLed process group may take to disappear


class Reaper:
    """SIGTERM, grace, SIGKILL and group clean-up for supervised children; see the module
    docstring. ``grace_s``: how long a child has to exit after SIGTERM; ``reap_s``: how long
    what is left of a dead child's process group has to exit before it is SIGKILLed."""

    def __init__(self, *, grace_s: float, reap_s: float) -> None:
        self.grace_s = grace_s
        self.reap_s = reap_s
        self.killed: list[str] = []  # what had to be SIGKILLed, and why

    def stop_rank(self, group: list[Child]) -> None:
        """SIGTERM every child of ``group`` still running, wait up to ``grace_s`` for them all,
        SIGKILL the ones left, then clear their process groups (``reap_s``)."""
        live = [c for c in group if c.returncode is None]
        for child in live:
            logger.info("stopping process=%s pid=%d", child.name, child.pid)
            signal_pid(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for child in live:
            if child.returncode is None:
                self.kill_child(child, f"did not exit within {self.grace_s:g}s of SIGTERM")
        self.clear_groups(group, self.reap_s)

    def kill_child(self, child: Child, why: str) -> None:
        """SIGKILL the child's own process (not its group: its engine may still clean up)."""
        what = f"{child.name} (pid {child.pid}) {why}"
        logger.warning("SIGKILL to %s", what)
        self.killed.append(what)
        signal_pid(child.pid, signal.SIGKILL)
        child.process.wait()

    def kill_all(self, children: list[Child]) -> None:
        """SIGKILL every child still running at once, then what is left of their groups."""
        for child in children:
            if child.returncode is None:
                self.kill_child(child, "was still running when the stop was interrupted")
        self.clear_groups(children, min(self.reap_s, 1.0))

    def clear_groups(self, children: list[Child], wait_s: float) -> None:
        """Empty the process groups of ``children`` (their current and earlier ones), giving
        them ``wait_s`` to exit on their own."""
        groups = [(c, c.pid) for c in children]
        groups += [(c, pgid) for c in children for pgid, _ in c.old_groups]
        for child in children:
            child.old_groups = []
        self.kill_leftovers(groups, wait_s=wait_s)

    def kill_leftovers(self, groups: list[tuple[Child, int]], *, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the (leaderless) process groups to empty, then SIGKILL
        what is left of each and wait briefly until it is gone."""
        deadline = time.monotonic() + wait_s
        while True:
            members = group_members([pgid for _, pgid in groups])
            left = [(c, pgid, members[pgid]) for c, pgid in groups if members.get(pgid)]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        for child, pgid, pids in left:
            what = (
                f"{child.name}'s process group {pgid} (pids {', '.join(map(str, pids))}) "
                f"still running {wait_s:g}s after {child.name} exited"
            )
            logger.warning("SIGKILL to %s", what)
            self.killed.append(what)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        if left:
            gone_by = time.monotonic() + _GONE_S
            pgids = [pgid for _, pgid, _ in left]
            while any(group_members(pgids).values()) and time.monotonic() < gone_by:
                time.sleep(_POLL_S)
