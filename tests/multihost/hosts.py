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
- Every set of hosts has an owner: its tag's lock file in :data:`OWNERS`, created locked (flock)
  and held until :meth:`TestHosts.close`. The sweep removes only what no live process owns, so
  sessions (pytest-xdist workers, or runs of their own) that overlap leave each other's hosts
  alone: a sweep that removed every ``PREFIX`` name killed the pods of another session's hosts.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
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
#: One lock file per set of hosts (``<tag>.lock``), locked by its owner while the hosts exist.
OWNERS = Path("/run/omt-owners")
_TAG_HEX = 4  # the tag's length: interface names hold at most 15 characters
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
    """Delete the namespaces, bridges and veths named ``PREFIX*`` that no live process owns (a
    killed session's); their names. Another session's hosts stay: their owner holds their lock."""
    by_tag: dict[str, list[tuple[str, str]]] = {}
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(f"{PREFIX}-"):
            by_tag.setdefault(_tag_of(name), []).append(("netns", name))
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX):
            by_tag.setdefault(_tag_of(name), []).append(("link", name))
    if OWNERS.is_dir():  # stale lock files whose hosts are gone
        for lock in OWNERS.glob("*.lock"):
            by_tag.setdefault(lock.stem, [])
    removed = []
    for tag, names in by_tag.items():
        owner = _claim(tag, fresh=False)
        if owner is None:
            continue  # a live session's hosts
        try:
            for kind, name in sorted(names, key=lambda kn: kn[0] != "netns"):  # netns first
                if kind == "netns":
                    _kill_netns_pids(name)
                    ip("netns", "delete", name, check=False)
                else:
                    ip("link", "delete", name, check=False)
                removed.append(name)
        finally:
            _release(tag, owner)
    return removed


def _tag_of(name: str) -> str:
    """The tag in a name made here: ``omt-<tag>-<host>``, ``omtbr<tag>``, ``omt<tag>v<i>``."""
    if name.startswith(f"{PREFIX}-"):
        return name.split("-")[1]
    rest = name.removeprefix(PREFIX).removeprefix("br")
    return rest[:_TAG_HEX]


def _claim(tag: str, *, fresh: bool) -> int | None:
    """Own ``tag``: a descriptor holding its lock file's flock, or None where a live process
    holds it (or, with ``fresh``, where the file exists at all). The file appears locked: it is
    made and locked under a temporary name, then linked into place."""
    OWNERS.mkdir(mode=0o700, exist_ok=True)
    path = OWNERS / f"{tag}.lock"
    tmp = OWNERS / f".{tag}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.link(tmp, path)
        return fd
    except FileExistsError:
        os.close(fd)
    finally:
        tmp.unlink()
    if fresh:
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:  # released meanwhile: nothing left to own
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its owner lives
        os.close(fd)
        return None
    if not os.path.exists(path) or os.stat(path).st_ino != os.fstat(fd).st_ino:
        os.close(fd)  # released and unlinked by the sweep or owner we raced
        return None
    return fd


def _release(tag: str, fd: int) -> None:
    """Give ``tag`` up (what it named is deleted): unlink its lock file, then unlock it."""
    with contextlib.suppress(FileNotFoundError):
        (OWNERS / f"{tag}.lock").unlink()
    os.close(fd)


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
        self.tag, owner = _new_tag()
        self._owner: int | None = owner
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
        if self._owner is not None:
            _release(self.tag, self._owner)
            self._owner = None


def _new_tag() -> tuple[str, int]:
    """A tag no other set of hosts holds, and the descriptor that owns it."""
    for _ in range(100):
        tag = secrets.token_hex(_TAG_HEX // 2)
        owner = _claim(tag, fresh=True)
        if owner is not None:
            return tag, owner
    raise RuntimeError(f"no free test-host tag in {OWNERS} after 100 tries")
