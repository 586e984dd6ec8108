"""Local network checks for the process supervisor and ``omni up``: whether a port is taken,
and a one-shot ``GET`` readiness probe (blocking, standard library only). A free port to give
a child: :func:`omni_mesh.procutil.free_port`."""

from __future__ import annotations

import http.client
import socket
from urllib.parse import urlsplit


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
