"""The local process supervisor against real child processes (small HTTP servers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_mesh.sidecar.supervisor import (
    ChildExitedError,
    ReadinessTimeoutError,
    Supervisor,
    free_port,
    http_ok,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# A child: prints a boot line, then (by mode) serves GET 200 on a port, crashes, ignores
# SIGTERM, or starts a grandchild in its own process group.
CHILD = r"""
import http.server, os, signal, subprocess, sys, time
port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
print(f"child booting pid={os.getpid()}", flush=True)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "grandchild":
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild={g.pid}", flush=True)
time.sleep(delay)
if mode == "crash":
    print("boom: cannot load the model", flush=True)
    sys.exit(3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if mode == "unhealthy" else 200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def child_argv(port: int, delay: float = 0.0, mode: str = "serve") -> list[str]:
    return [sys.executable, "-c", CHILD, str(port), str(delay), mode]


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: PID 1 here may not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def wait_for_line(path: Path, prefix: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else ():
            if line.startswith(prefix):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line starting with {prefix!r} in {path}")


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    supervisor = Supervisor(log_dir=tmp_path / "logs", grace_s=2.0)
    try:
        yield supervisor
    finally:
        supervisor.close()


def test_waits_for_readiness_and_stop_leaves_no_process(sup: Supervisor) -> None:
    ports = [free_port() for _ in range(3)]
    children = [
        sup.start(
            f"web-{i}", child_argv(port, delay=0.3 * i), ready_url=f"http://127.0.0.1:{port}/h"
        )
        for i, port in enumerate(ports)
    ]
    assert sup.wait_ready(timeout_s=30)
    assert all(http_ok(f"http://127.0.0.1:{port}/h") for port in ports)
    sup.check()  # nothing exited

    sup.stop()

    assert wait_gone([c.pid for c in children], timeout_s=0.5) == []
    assert all(c.returncode == -signal.SIGTERM for c in children)
    assert "child booting" in children[0].log_tail()


def test_readiness_timeout_names_the_process_and_shows_its_log(sup: Supervisor) -> None:
    port = free_port()
    sup.start("sick", child_argv(port, mode="unhealthy"), ready_url=f"http://127.0.0.1:{port}/")
    with pytest.raises(ReadinessTimeoutError) as err:
        sup.wait_ready(timeout_s=1.0)
    message = str(err.value)
    assert "'sick'" in message and f"http://127.0.0.1:{port}/" in message
    assert "child booting" in message


def test_child_dying_during_start_is_reported_at_once(sup: Supervisor) -> None:
    port = free_port()
    sup.start("doomed", child_argv(port, 0.2, "crash"), ready_url=f"http://127.0.0.1:{port}/")
    started = time.monotonic()
    with pytest.raises(ChildExitedError) as err:
        sup.wait_ready(timeout_s=30)
    assert time.monotonic() - started < 10
    assert err.value.name == "doomed" and err.value.returncode == 3
    assert "exited with code 3" in str(err.value)
    assert "boom: cannot load the model" in err.value.log_tail


def test_unexpected_exit_while_running_is_reported(sup: Supervisor) -> None:
    sup.start("steady", child_argv(free_port()))
    sup.start("flaky", child_argv(free_port(), 0.3, "crash"))
    with pytest.raises(ChildExitedError) as err:
        sup.wait(threading.Event(), poll_s=0.05)
    assert err.value.name == "flaky"
    assert "'flaky'" in str(err.value) and "boom" in str(err.value)


def test_wait_returns_when_cancelled(sup: Supervisor) -> None:
    port = free_port()
    sup.start("slow", child_argv(port, delay=30), ready_url=f"http://127.0.0.1:{port}/")
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    assert sup.wait_ready(timeout_s=30, cancel=cancel) is False
    sup.wait(cancel)  # already set: returns at once


def test_stop_kills_a_child_ignoring_sigterm_and_its_grandchildren(tmp_path: Path) -> None:
    with Supervisor(log_dir=tmp_path, grace_s=0.5) as sup:
        stubborn = sup.start("stubborn", child_argv(free_port(), mode="ignore-term"))
        parent = sup.start("parent", child_argv(free_port(), mode="grandchild"))
        grandchild = int(wait_for_line(parent.log_path, "grandchild=").split("=")[1])
        wait_for_line(stubborn.log_path, "child booting")
        started = time.monotonic()
        sup.stop()
        assert time.monotonic() - started < 5
    assert stubborn.returncode == -signal.SIGKILL
    assert wait_gone([stubborn.pid, parent.pid, grandchild]) == []


def test_close_removes_its_own_log_dir_unless_kept() -> None:
    with Supervisor() as sup:
        sup.start("quick", [sys.executable, "-c", "print('hi')"])
        own = sup.log_dir
    assert not own.exists()
    with Supervisor(keep_logs=True) as sup:
        code = "import time; print('hi', flush=True); time.sleep(60)"
        child = sup.start("quick", [sys.executable, "-c", code])
        wait_for_line(child.log_path, "hi")
        kept = sup.log_dir
    try:
        assert child.log_path.read_text() == "hi\n"
    finally:
        for f in kept.iterdir():
            f.unlink()
        kept.rmdir()


def test_start_rejects_duplicate_and_odd_names(sup: Supervisor) -> None:
    sup.start("one", [sys.executable, "-c", "pass"])
    with pytest.raises(ValueError, match="already supervised"):
        sup.start("one", [sys.executable, "-c", "pass"])
    with pytest.raises(ValueError, match="bad process name"):
        sup.start("../escape", [sys.executable, "-c", "pass"])


# The supervisor in a process of its own, killed with SIGKILL: its children must die too.
SUPERVISING = r"""
import json, sys, time
from pathlib import Path
from omni_mesh.sidecar.supervisor import Supervisor, free_port
argv = json.loads(sys.argv[2])
sup = Supervisor(log_dir=Path(sys.argv[1]))
pids = [sup.start(f"c{i}", [*argv, str(free_port()), "0", "serve"]).pid for i in range(2)]
print(json.dumps(pids), flush=True)
time.sleep(600)
"""


def test_children_die_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    child_cmd = json.dumps([sys.executable, "-c", CHILD])
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISING, str(tmp_path), child_cmd],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        pids = json.loads(proc.stdout.readline())
        assert all(alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert wait_gone(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_free_port_can_be_bound() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
