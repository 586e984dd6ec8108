"""The shared-memory arena (DESIGN invariant 4: bytes move once per host, /dev/shm never leaks).

Segments are plain files under :data:`SHM_DIR` (``/dev/shm``), created ``O_EXCL`` with mode
0600, sized with ``ftruncate`` + ``posix_fallocate`` (a full tmpfs is an error at allocation,
not a SIGBUS at first write) and mapped with ``mmap``. They are named
``omni-{pid}-{token}-{seq}``: ``token`` is random per arena and ``seq`` is never reused, so a
reader's cached mapping can never alias a newer segment.

This module is the public face; the parts live beside it:

* :class:`ShmArena` (``shm_arena``) — the writer side: power-of-two size classes, one slot per
  segment, freed segments pooled and reused (writing into a fresh segment page-faults at ~1/10
  memcpy speed), every slot owned by a request id and freed with :meth:`ShmArena.free_owner`.
* :class:`ShmReader` (``shm_reader``) — the reader side: maps segments read-only on first use,
  LRU-cached.
* :func:`unlink_prefix` / :func:`sweep_orphans` (``shm_cleanup``) — janitors for crashed
  processes.
* :func:`externalize` / :func:`inline` (``shm_payload``) — move a payload's tensors into / out
  of slots.
* ``shm_common`` — naming, errors and helpers the others share.

``multiprocessing.shared_memory`` is deliberately not used: its resource tracker unlinks
segments it does not own and warns at exit.
"""

from __future__ import annotations

import os

from omni_mesh.data_plane.shm_arena import ArenaStats, ShmArena, ShmSlot
from omni_mesh.data_plane.shm_cleanup import sweep_orphans, unlink_prefix
from omni_mesh.data_plane.shm_common import (
    SEGMENT_PREFIX,
    SHM_DIR,
    ShmArenaFull,
    ShmError,
    ShmRefError,
)
from omni_mesh.data_plane.shm_payload import externalize, inline
from omni_mesh.data_plane.shm_reader import ShmReader

__all__ = [
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "ArenaStats",
    "ShmArena",
    "ShmArenaFull",
    "ShmError",
    "ShmReader",
    "ShmRefError",
    "ShmSlot",
    "arena_budget",
    "externalize",
    "inline",
    "sweep_orphans",
    "unlink_prefix",
]


def arena_budget(fraction: float = 0.4, *, directory: str | None = None) -> int:
    """A bound for one arena: ``fraction`` of the shared-memory filesystem's size, so that a
    pod's two arenas together never fill it (a full ``/dev/shm`` would SIGBUS a writer)."""
    st = os.statvfs(directory or SHM_DIR)
    return max(64 << 20, int(st.f_blocks * st.f_frsize * fraction))
