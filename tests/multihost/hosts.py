"""Test hosts on one machine: network namespaces joined by a Linux bridge (needs root + iproute2).

- :class:`TestHosts` makes N hosts ``<prefix>-<tag>-<name>``, each with ``lo`` and one ``eth0``
  (a veth whose peer is on the bridge) holding ``10.213.<k>.<i>/24``. Addresses live only inside
  the namespaces made here; the bridge has none, so the test process itself cannot reach the
  hosts: it talks to them from threads moved into a host's namespace (:meth:`Host.enter`,
  :meth:`Host.run`), which is what a client on that host would do.
- :meth:`Host.spawn` starts a process inside the host (``ip netns exec``, same PID) as a
  :class:`tests.procs.ManagedProcess`, so the session fixture kills it whatever happens.
- Faults: :meth:`Host.link_down` / :meth:`Host.link_up` (silent: packets vanish, no RST),
  :meth:`Host.drop_to` / :meth:`Host.heal` (a silent partition between chosen hosts),
  :meth:`Host.blackhole` (routes that refuse at once), :meth:`Host.netem` (delay, loss; the
  kernel of the 2-core CI machines has no ``sch_netem``, nor ``tc`` classifiers).
- :meth:`TestHosts.close` stops every process started on the hosts and deletes the namespaces,
  veths and bridge, on failure too; :func:`sweep_leftovers` removes whatever a killed test
  session left (names with :data:`PREFIX`), and runs at the start of every session.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest

from tests.procs import ManagedProcess, clean_env

#: Every namespace, bridge and veth made here starts with this (the leftover sweep's key).
PREFIX = "omt"
#: A locally administered MAC that no test host has (see :meth:`Host.drop_to`).
_NOBODY_MAC = "02:00:5e:00:de:ad"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def available() -> str | None:
    """Why test hosts cannot be made here (not root, no ip/tc), or None."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian iproute2; `make test-tools` installs it)"
    return None


def sweep_leftovers() -> list[str]:
    """Delete namespaces, bridges and veths named ``PREFIX*`` (a killed session's); names."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(f"{PREFIX}-"):
            _kill_netns_pids(name)
            ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX):
            ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def _kill_netns_pids(name: str) -> None:
    pids = ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


class Host:
    """One test host: a network namespace with one address on the bridge."""

    def __init__(self, hosts: TestHosts, name: str, netns: str, address: str, veth: str) -> None:
        self.hosts = hosts
        self.name = name
        self.netns = netns
        self.address = address
        self.veth = veth  # the bridge side of this host's link
        self.procs: list[ManagedProcess] = []

    def __repr__(self) -> str:
        return f"Host({self.name} {self.address})"

    def sh(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a short command inside the host."""
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *argv],
            capture_output=True,
            text=True,
            timeout=20,
            check=check,
        )

    def spawn(
        self, argv: Sequence[str], *, name: str, env: dict[str, str] | None = None
    ) -> ManagedProcess:
        """Start ``argv`` inside the host (its PID is the process's own)."""
        proc = ManagedProcess(
            ["ip", "netns", "exec", self.netns, *argv],
            name=f"{self.name}-{name}",
            env=env or clean_env(),
            log_dir=self.hosts.log_dir,
        ).start()
        self.procs.append(proc)
        return proc

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Move the calling thread into the host's network namespace (use a fresh thread)."""
        with open(f"/var/run/netns/{self.netns}") as ns:
            if _libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {self.netns}")
        yield

    def run(self, fn: Callable[[], T], timeout: float = 120.0) -> T:
        """``fn()`` in a thread inside the host; its result (or its exception)."""
        box: dict[str, object] = {}

        def target() -> None:
            try:
                with self.enter():
                    box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError(f"{fn!r} on {self.name} did not return in {timeout}s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]

    # ---- faults ----------------------------------------------------------------------------

    def link_down(self) -> None:
        """The host drops off the network silently: its packets vanish, nobody gets a reset."""
        ip("link", "set", self.veth, "down")

    def link_up(self) -> None:
        ip("link", "set", self.veth, "up")

    def drop_to(self, *others: Host) -> None:
        """Silently drop every packet between this host and ``others``, both directions.

        Each side gets a permanent neighbour entry for the other's address with a MAC that
        nobody owns: frames go out and vanish, as across a broken router (this kernel has no
        ``tc`` classifiers or actions, and no iptables, to drop them otherwise)."""
        for other in others:
            for src, dst in ((self, other), (other, self)):
                src.sh("ip", "neigh", "replace", dst.address, "lladdr", _NOBODY_MAC,
                       "dev", "eth0", "nud", "permanent")  # fmt: skip

    def blackhole(self, *others: Host) -> None:
        """Routes that refuse at once (not silent) between this host and ``others``."""
        for other in others:
            self.sh("ip", "route", "add", "blackhole", f"{other.address}/32")
            other.sh("ip", "route", "add", "blackhole", f"{self.address}/32")

    def heal(self, *others: Host) -> None:
        """Undo :meth:`drop_to` and :meth:`blackhole` between this host and ``others``."""
        for other in others:
            for src, dst in ((self, other), (other, self)):
                src.sh("ip", "neigh", "del", dst.address, "dev", "eth0", check=False)
                src.sh("ip", "route", "del", "blackhole", f"{dst.address}/32", check=False)

    def netem(self, spec: str) -> None:
        """``tc netem`` on the host's link, e.g. ``"delay 2ms"``; skips the test when the
        kernel has no ``sch_netem`` (as on the 2-core CI machines)."""
        done = self.sh("tc", "qdisc", "replace", "dev", "eth0", "root", "netem", *spec.split(),
                       check=False)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"tc netem unavailable on this kernel: {done.stderr.strip()}")


class TestHosts:
    """N test hosts on one bridge; :meth:`close` removes everything."""

    __test__ = False  # not a test class

    def __init__(self, names: Sequence[str], log_dir: Path) -> None:
        problem = available()
        if problem is not None:
            pytest.skip(problem)
        self.tag = secrets.token_hex(2)
        self.log_dir = log_dir
        self.bridge = f"{PREFIX}br{self.tag}"
        subnet = 10 + os.getpid() % 240
        self.hosts: dict[str, Host] = {}
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names, start=1):
                self._add(name, i, f"10.213.{subnet}.{i}")
        except BaseException:
            self.close()
            raise

    def _add(self, name: str, index: int, address: str) -> None:
        netns = f"{PREFIX}-{self.tag}-{name}"
        veth, peer = f"{PREFIX}{self.tag}v{index}", f"{PREFIX}{self.tag}p{index}"
        ip("netns", "add", netns)
        self.hosts[name] = host = Host(self, name, netns, address, veth)
        ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", netns)
        ip("link", "set", veth, "master", self.bridge)
        ip("link", "set", veth, "up")
        host.sh("ip", "link", "set", "lo", "up")
        host.sh("ip", "link", "set", peer, "name", "eth0")
        host.sh("ip", "addr", "add", f"{address}/24", "dev", "eth0")
        host.sh("ip", "link", "set", "eth0", "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:
                with contextlib.suppress(Exception):
                    proc.terminate(timeout=15) if proc.alive else proc.cleanup()
        for host in self.hosts.values():
            _kill_netns_pids(host.netns)
            ip("netns", "delete", host.netns, check=False)
            ip("link", "delete", host.veth, check=False)
        ip("link", "delete", self.bridge, check=False)
