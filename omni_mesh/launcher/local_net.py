"""Local network checks for the process supervisor and ``omni up``: a free TCP port, whether a
port is taken, and a one-shot ``GET`` readiness probe (blocking, standard library only)."""

from __future__ import annotations

import http.client
import random
import socket
from pathlib import Path
from urllib.parse import urlsplit

#: Lowest port :func:`free_port` picks. Ports are drawn from ``[FREE_PORT_LOW, ephemeral low)``.
FREE_PORT_LOW = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FALLBACK_EPHEMERAL_LOW = 32768  # Linux's default when the range cannot be read


def _read_ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


#: Read once, at import: free_port() is also called from inside event loops (no file I/O there).
_EPHEMERAL_LOW = _read_ephemeral_low()


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (the ports ``bind(0)`` and outgoing
    connections get), from ``/proc/sys/net/ipv4/ip_local_port_range`` as it was at import."""
    return _EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, chosen **below** the kernel's ephemeral
    range: a port picked now and bound later (a launcher's or a test's child process) cannot be
    taken meanwhile by a port the kernel hands out on its own (vLLM opens ~20 such sockets while
    it starts). Drawn at random in ``[FREE_PORT_LOW, ephemeral_low())`` and checked by binding;
    falls back to a kernel-chosen port when that window is empty or full."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if high > FREE_PORT_LOW else 0):
        port = rng.randrange(FREE_PORT_LOW, high)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        chosen: int = s.getsockname()[1]
        return chosen


def port_in_use(host: str, port: int) -> bool:
    """True when binding ``host:port`` fails with EADDRINUSE-like errors."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when ``GET url`` answers 200 (no proxies, no redirects)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad readiness URL {url!r}")
    conn_cls = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout_s)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target)
        response = conn.getresponse()
        response.read()
        return response.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
