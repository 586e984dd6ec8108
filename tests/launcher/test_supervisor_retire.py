"""Removing a supervised child on purpose (the autoscaler's scale-down) and probing children
started late, against real child processes: a retired child gets SIGTERM, is never restarted
and leaves the supervisor once it exited (0); one that ignores SIGTERM is SIGKILLed after the
grace (recorded); a child started with ``probe=True`` becomes ready through ``check()``."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from omni_mesh.launcher.supervisor import RestartPolicy, Supervisor, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# Serves GET 200 after ``delay`` s; on SIGTERM exits 0 after 0.2 s ("drain") unless told to
# ignore it.
CHILD = r"""
import http.server, os, signal, sys, threading, time
port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
def on_term(*_):
    print("draining", flush=True)
    time.sleep(0.2)
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore-term" else on_term)
time.sleep(delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _start(sup: Supervisor, name: str, *, delay: float = 0.0, mode: str = "serve",
           probe: bool = False) -> tuple[str, int]:  # fmt: skip
    port = free_port("127.0.0.1")
    sup.start(
        name,
        [sys.executable, "-c", CHILD, str(port), str(delay), mode],
        ready_url=f"http://127.0.0.1:{port}/",
        restart=RestartPolicy(backoff_initial_s=0.05, ready_timeout_s=20),
        probe=probe,
    )
    return name, port


def _until(cond: Callable[[], bool], sup: Supervisor, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        sup.check()
        time.sleep(0.05)


def test_a_retired_child_drains_exits_and_is_never_restarted(tmp_path: Path) -> None:
    with Supervisor(log_dir=tmp_path, grace_s=5.0) as sup:
        _start(sup, "keep")
        _start(sup, "retire-me")
        sup.wait_ready(timeout_s=20)
        child = next(c for c in sup.children if c.name == "retire-me")
        sup.retire(child, "test: scale down")
        sup.retire(child, "again")  # idempotent
        _until(lambda: child not in sup.children, sup)
        assert child.returncode == 0
        assert "draining" in child.log_tail()
        time.sleep(0.3)
        sup.check()  # no restart, no error
        assert [c.name for c in sup.children] == ["keep"]
        assert child.restarts == 0 and sup.killed == []


def test_a_retired_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    with Supervisor(log_dir=tmp_path, grace_s=0.5) as sup:
        _start(sup, "stubborn", mode="ignore-term")
        sup.wait_ready(timeout_s=20)
        [child] = sup.children
        sup.retire(child, "test")
        _until(lambda: not sup.children, sup)
        assert child.returncode == -signal.SIGKILL
        assert len(sup.killed) == 1 and "stubborn" in sup.killed[0]


def test_a_child_started_with_probe_becomes_ready_through_check(tmp_path: Path) -> None:
    with Supervisor(log_dir=tmp_path) as sup:
        _start(sup, "late", delay=0.5, probe=True)
        [child] = sup.children
        assert not child.ready
        _until(lambda: child.ready, sup)
        assert child.ever_ready
        sup.retire(child, "done")  # retiring a ready child during stop() is fine too
    assert child.returncode == 0
