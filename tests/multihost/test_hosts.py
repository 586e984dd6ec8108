"""The test-host helper itself: hosts reach each other only through the bridge, faults do what
they say (silent link down, silent drops, blackholes), nothing is left after close, and the
leftover sweep removes a dead session's hosts only, never a live one's."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost.hosts import PREFIX, TestHosts, ip, sweep_leftovers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_ROOT = Path(__file__).resolve().parents[2]
#: A session that makes one host and dies without closing it (as a killed test run does).
_DIES_HOLDING_HOSTS = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from tests.multihost.hosts import TestHosts\n"
    "print(TestHosts(['a'], Path(sys.argv[1])).tag, flush=True)\n"
    "os._exit(0)\n"
)


def _connect(address: str, port: int, timeout: float) -> str:
    t0 = time.monotonic()
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.sendall(b"ping\n")
            return sock.recv(16).decode()
    except TimeoutError:
        return f"timeout after {time.monotonic() - t0:.1f}s"
    except OSError as exc:
        return type(exc).__name__


def test_hosts_reach_each_other_and_faults(tmp_path: Path) -> None:
    hosts = TestHosts(["a", "b", "c"], tmp_path)
    names = [h.netns for h in hosts.hosts.values()]
    try:
        a, b, c = hosts["a"], hosts["b"], hosts["c"]
        echo = "import socket,sys\ns=socket.create_server((sys.argv[1],7000))\n"
        echo += "while True:\n c,_=s.accept(); c.recv(16); c.sendall(b'pong'); c.close()\n"
        server = b.spawn([sys.executable, "-c", echo, b.address], name="echo")
        deadline = time.monotonic() + 10
        while a.run(lambda: _connect(b.address, 7000, 1.0)) != "pong":
            assert time.monotonic() < deadline, server.describe()
            time.sleep(0.1)
        assert c.run(lambda: _connect(b.address, 7000, 1.0)) == "pong"
        # the test process (root namespace) has no route to the hosts' addresses
        assert _connect(b.address, 7000, 0.5) != "pong"

        b.link_down()  # silent: a connect times out, it is not refused
        assert a.run(lambda: _connect(b.address, 7000, 1.0)).startswith("timeout")
        b.link_up()
        assert a.run(lambda: _connect(b.address, 7000, 2.0)) == "pong"

        a.drop_to(b)  # a <-> b silent, c still reaches b
        assert a.run(lambda: _connect(b.address, 7000, 1.0)).startswith("timeout")
        assert c.run(lambda: _connect(b.address, 7000, 1.0)) == "pong"
        a.heal(b)
        assert a.run(lambda: _connect(b.address, 7000, 2.0)) == "pong"

        c.blackhole(b)  # refused at once
        assert c.run(lambda: _connect(b.address, 7000, 1.0)) in (
            "OSError",
            "ConnectionRefusedError",
        )
        c.heal(b)
        assert c.run(lambda: _connect(b.address, 7000, 2.0)) == "pong"
    finally:
        hosts.close()
    left = ip("netns", "list").stdout + ip("-o", "link", "show").stdout
    assert not any(n in left for n in names), left
    assert f"{PREFIX}br{hosts.tag}" not in left


def test_the_sweep_removes_a_dead_sessions_hosts_and_leaves_a_live_ones(tmp_path: Path) -> None:
    live = TestHosts(["a"], tmp_path / "live")
    try:
        dead = subprocess.run(
            [sys.executable, "-c", _DIES_HOLDING_HOSTS, str(tmp_path / "dead")],
            cwd=_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
        dead_names = [f"{PREFIX}-{dead}-a", f"{PREFIX}br{dead}"]
        live_names = [live["a"].netns, live["a"].veth, f"{PREFIX}br{live.tag}"]
        before = ip("netns", "list").stdout + ip("-o", "link", "show").stdout
        assert all(n in before for n in dead_names + live_names), before

        removed = sweep_leftovers()
        left = ip("netns", "list").stdout + ip("-o", "link", "show").stdout
        assert all(n in removed and n not in left for n in dead_names), (removed, left)
        assert all(n in left for n in live_names), left
        assert not any(n in removed for n in live_names), removed
        # the live hosts still work
        assert live["a"].sh("ip", "addr", "show", "eth0").returncode == 0
    finally:
        live.close()
