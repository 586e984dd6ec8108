"""The local process supervisor against real child processes (small HTTP servers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from omni_mesh.launcher.supervisor import (
    ChildExitedError,
    ReadinessTimeoutError,
    RestartLimitError,
    RestartPolicy,
    Supervisor,
    free_port,
    http_ok,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# A child: prints a boot line, then (by mode) serves GET 200 on a port, crashes, ignores
# SIGTERM, starts a grandchild in its own process group, serves for a while and then crashes,
# logs SIGTERM and exits slowly, or ignores SIGTERM while a helper with PDEATHSIG (an engine)
# cleans up when it dies.
CHILD = r"""
import http.server, os, signal, subprocess, sys, threading, time
port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
print(f"child booting pid={os.getpid()}", flush=True)
if mode in ("ignore-term", "engine"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "grandchild":
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild={g.pid}", flush=True)
if mode == "engine":
    g = subprocess.Popen([sys.executable, "-c", ENGINE, sys.argv[4]])
    print(f"engine={g.pid}", flush=True)
if mode == "slow-term":
    def on_term(*_):
        print(f"sigterm at {time.time()}", flush=True)
        time.sleep(0.3)
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
time.sleep(delay if mode != "serve-then-crash" else 0)
if mode == "crash":
    print("boom: cannot load the model", flush=True)
    sys.exit(3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if mode == "unhealthy" else 200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), H)
if mode == "serve-then-crash":
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(delay)
    print("boom: lost the device", flush=True)
    os._exit(3)
server.serve_forever()
"""
# The helper of mode "engine": dies with its parent (PDEATHSIG), cleaning up first.
ENGINE = r"""
import ctypes, signal, sys, time
def on_term(*_):
    open(sys.argv[1], "w").write("cleaned up")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)
print("engine ready", flush=True)
while True:
    time.sleep(1)
"""
CHILD = CHILD.replace("ENGINE", repr(ENGINE))


def child_argv(port: int, delay: float = 0.0, mode: str = "serve", *extra: str) -> list[str]:
    return [sys.executable, "-c", CHILD, str(port), str(delay), mode, *extra]


FAST = RestartPolicy(backoff_initial_s=0.1, backoff_max_s=0.4, max_failures=3, window_s=60)


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
    with Supervisor(log_dir=tmp_path, grace_s=0.5, reap_s=0.5) as sup:
        stubborn = sup.start("stubborn", child_argv(free_port(), mode="ignore-term"))
        parent = sup.start("parent", child_argv(free_port(), mode="grandchild"))
        grandchild = int(wait_for_line(parent.log_path, "grandchild=").split("=")[1])
        wait_for_line(stubborn.log_path, "child booting")
        started = time.monotonic()
        sup.stop()
        assert time.monotonic() - started < 5
    assert stubborn.returncode == -signal.SIGKILL
    assert wait_gone([stubborn.pid, parent.pid, grandchild]) == []
    assert len(sup.killed) == 2, sup.killed
    assert any(k.startswith(f"stubborn (pid {stubborn.pid}) did not exit") for k in sup.killed)
    assert any(k.startswith("parent's process group") and str(grandchild) in k for k in sup.killed)


def test_sigkill_goes_to_the_child_first_so_its_engine_cleans_up(tmp_path: Path) -> None:
    marker = tmp_path / "engine-cleaned"
    with Supervisor(log_dir=tmp_path / "logs", grace_s=0.5, reap_s=5.0) as sup:
        pod = sup.start("pod", child_argv(free_port(), 0, "engine", str(marker)))
        engine = int(wait_for_line(pod.log_path, "engine=").split("=")[1])
        wait_for_line(pod.log_path, "engine ready")
        sup.stop()
    assert pod.returncode == -signal.SIGKILL
    assert wait_gone([engine]) == []
    assert marker.read_text() == "cleaned up"  # got PDEATHSIG, not SIGKILL
    assert sup.killed == [f"pod (pid {pod.pid}) did not exit within 0.5s of SIGTERM"]


def test_stop_goes_rank_by_rank_each_rank_together(sup: Supervisor) -> None:
    ranks = {"api": 0, "stage0-a": 1, "stage0-b": 1, "cp": 2}
    children = {
        name: sup.start(name, child_argv(free_port(), 0, "slow-term"), stop_rank=rank)
        for name, rank in ranks.items()
    }
    for child in children.values():
        wait_for_line(child.log_path, "child booting")
    time.sleep(0.3)  # let them install their SIGTERM handlers
    sup.stop()
    at = {
        name: float(wait_for_line(c.log_path, "sigterm at ").split()[-1])
        for name, c in children.items()
    }
    assert all(c.returncode == 0 for c in children.values())
    assert abs(at["stage0-a"] - at["stage0-b"]) < 0.25  # one rank: together
    assert at["stage0-a"] - at["api"] >= 0.25  # the next rank once the one before is gone
    assert at["cp"] - max(at["stage0-a"], at["stage0-b"]) >= 0.25
    assert sup.killed == []


def _check_until(sup: Supervisor, predicate: Callable[[], bool], timeout_s: float) -> None:
    """Run the supervisor's check (restarts happen there) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        sup.check()
        time.sleep(0.05)


def test_a_dead_child_is_restarted_on_the_same_port_with_backoff(sup: Supervisor) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    child = sup.start("web", child_argv(port), ready_url=url, restart=FAST)
    assert sup.wait_ready(timeout_s=30)
    for n in (1, 2):
        first = child.pid
        os.kill(first, signal.SIGKILL)
        killed_at = time.monotonic()
        _check_until(sup, lambda old=first: child.pid != old and child.ready, timeout_s=20)
        assert time.monotonic() - killed_at >= FAST.backoff_s(n)  # 0.1 s, then 0.2 s
        assert http_ok(url) and child.restarts == n
    assert f"---- supervisor: restart {n} ----" in child.log_path.read_text()
    assert child.log_path.read_text().count("child booting") == 3  # one log, appended
    sup.stop()
    assert sup.killed == [] and wait_gone([child.pid]) == []


def test_a_child_failing_over_and_over_is_given_up(sup: Supervisor) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    sup.start("steady", child_argv(free_port()), restart=FAST)
    child = sup.start(
        "flaky", child_argv(port, 0.8, "serve-then-crash"), ready_url=url, restart=FAST
    )
    assert sup.wait_ready(timeout_s=30)
    with pytest.raises(RestartLimitError) as err:
        _check_until(sup, lambda: False, timeout_s=30)
    assert err.value.name == "flaky" and err.value.returncode == 3
    assert "failed 3 times" in str(err.value) and "giving up" in str(err.value)
    assert "boom: lost the device" in str(err.value)
    assert child.restarts == 2


def test_a_restartable_child_dying_before_it_was_ever_ready_is_fatal(sup: Supervisor) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    sup.start("broken", child_argv(port, 0.1, "crash"), ready_url=url, restart=FAST)
    with pytest.raises(ChildExitedError) as err:
        sup.wait_ready(timeout_s=30)
    assert not isinstance(err.value, RestartLimitError)
    assert err.value.name == "broken" and "before it was ever ready" in str(err.value)


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
from omni_mesh.launcher.supervisor import Supervisor, free_port
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
