"""Child-process plumbing shared by every package that starts processes (the sidecar's engine,
the embedded Redis, omni-up's children): dying with the parent, and a free port to bind later
(omni-up's children, the tests' processes, a vLLM engine's NIXL side channel). Imports nothing
of ours."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` making the child receive ``sig`` when the thread that started it dies
    (Linux ``PR_SET_PDEATHSIG``), so that nothing outlives a ``kill -9`` of its parent. If the
    parent is already gone when the hook runs (a race prctl cannot see), the child exits.
    libc is resolved here, before the fork; the hook only calls into it. ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getpid()

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return hook


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
