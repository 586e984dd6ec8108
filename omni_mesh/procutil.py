"""Child-process plumbing shared by every package that starts processes (the sidecar's engine,
the embedded Redis, omni-up's children). Imports nothing of ours."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

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
