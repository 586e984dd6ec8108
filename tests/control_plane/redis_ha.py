"""Debian's ``redis-server`` and ``redis-sentinel`` on loopback: one primary, one replica and
three sentinels watching them (:class:`SentinelGroup`), and a TLS/password redis-server
(:func:`start_redis`). Every process is a :class:`tests.procs.ManagedProcess`, so the session
fixture kills whatever a failing test leaves behind."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.procs import LOCALHOST, ManagedProcess, free_port, wait_until

SERVICE = "omni-primary"


def debian_binary(name: str) -> str:
    """``/usr/bin/<name>`` from the Debian package (skip when absent: ``make test-tools``)."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian package; `make test-tools` installs it as root)")
    return path


def redis_cmd(port: int, *args: str, timeout: float = 1.0) -> str:
    """One inline command over a raw socket; the first reply line (errors included)."""
    with socket.create_connection((LOCALHOST, port), timeout=timeout) as sock:
        sock.sendall((" ".join(args) + "\r\n").encode())
        return sock.recv(65536).decode(errors="replace").split("\r\n")[0]


def start_redis(
    log_dir: Path, port: int, extra: Sequence[str] = (), *, name: str
) -> ManagedProcess:
    """A Debian redis-server on ``port`` (``port=0`` with ``--tls-port`` in ``extra``)."""
    data = log_dir / f"{name}-data"
    data.mkdir(parents=True, exist_ok=True)
    argv = [
        debian_binary("redis-server"),
        "--bind", LOCALHOST,
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--protected-mode", "no",
        "--dir", str(data),
        *extra,
    ]  # fmt: skip
    proc = ManagedProcess(argv, name=name, log_dir=log_dir).start()
    try:
        proc.wait_for_output(r"(?i)ready to accept connections", 15)
    except BaseException:
        proc.cleanup()
        raise
    return proc


class SentinelGroup:
    """A primary, a replica and three sentinels (quorum 2) on free loopback ports."""

    def __init__(self, *, down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="omni-test-sentinel-"))
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.redis_ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.redis: dict[int, ManagedProcess] = {}
        self.sentinels: list[ManagedProcess] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"{LOCALHOST}:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def start(self) -> SentinelGroup:
        primary, replica = self.redis_ports
        self.redis[primary] = start_redis(self.dir, primary, name=f"primary-{primary}")
        self.redis[replica] = start_redis(
            self.dir, replica, ["--replicaof", LOCALHOST, str(primary)], name=f"replica-{replica}"
        )
        wait_until(
            lambda: "master_link_status:up" in self.info(replica, "replication"),
            15,
            message="replica never synced",
        )
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind {LOCALHOST}\nprotected-mode no\ndaemonize no\n"
                f"dir {self.dir}\n"
                f"sentinel monitor {SERVICE} {LOCALHOST} {primary} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            argv = [debian_binary("redis-sentinel"), str(conf)]
            proc = ManagedProcess(argv, name=f"sentinel-{port}", log_dir=self.dir).start()
            self.sentinels.append(proc)
        for port in self.sentinel_ports:
            wait_until(
                lambda p=port: self._sentinel_sees_all(p),  # type: ignore[misc]
                20,
                message=f"sentinel {port} never saw the replica and the other sentinels",
            )
        return self

    def _sentinel_sees_all(self, port: int) -> bool:
        try:
            reply = redis_cmd(port, "SENTINEL", "MASTER", SERVICE)
            info = self._raw(port, "INFO sentinel")
        except OSError:
            return False
        return bool(reply) and f"slaves=1,sentinels={len(self.sentinel_ports)}" in info

    @staticmethod
    def _raw(port: int, command: str) -> str:
        with socket.create_connection((LOCALHOST, port), timeout=1.0) as sock:
            sock.sendall((command + "\r\n").encode())
            return sock.recv(65536).decode(errors="replace")

    def info(self, port: int, section: str) -> str:
        try:
            return self._raw(port, f"INFO {section}")
        except OSError:
            return ""

    def primary_port(self) -> int | None:
        """The port of the primary as the first answering sentinel sees it."""
        for port in self.sentinel_ports:
            try:
                with socket.create_connection((LOCALHOST, port), timeout=1.0) as sock:
                    sock.sendall(f"SENTINEL GET-MASTER-ADDR-BY-NAME {SERVICE}\r\n".encode())
                    lines = sock.recv(4096).decode().split("\r\n")
                return int(lines[4])
            except (OSError, IndexError, ValueError):
                continue
        return None

    def kill_primary(self) -> int:
        """``kill -9`` the current primary; its port."""
        port = self.primary_port()
        assert port is not None
        self.redis[port].kill()
        return port

    def close(self) -> None:
        for proc in [*self.sentinels, *self.redis.values()]:
            proc.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)
