"""What every part of the shared-memory arena shares: segment naming, the errors, where the
segments live and how a mapping is let go. The public face is :mod:`omni_mesh.data_plane.shm`.
"""

from __future__ import annotations

import logging
import mmap
import re

log = logging.getLogger("omni_mesh.data_plane.shm")

SEGMENT_PREFIX = "omni-"
_NAME = re.compile(r"^omni-[A-Za-z0-9_.\-]{1,200}$")


class ShmError(RuntimeError):
    """A shared-memory operation failed."""


class ShmArenaFull(ShmError):
    """The arena's byte cap or the shared-memory filesystem is exhausted."""


class ShmRefError(ShmError, ValueError):
    """A :class:`ShmRef` names no readable slot (missing segment, bad name, out of bounds)."""


#: Where segments live unless a caller names another folder (tests use their own).
SHM_DIR = "/dev/shm"


def resolve_directory(directory: str | None) -> str:
    """``directory``, else :data:`SHM_DIR`."""
    return SHM_DIR if directory is None else directory


def check_name(name: str, what: str) -> None:
    if not _NAME.fullmatch(name) or name.endswith("-"):
        raise ShmRefError(f"invalid shared-memory {what} {name!r} (expected 'omni-…')")


def unmap(mm: mmap.mmap, view: memoryview) -> None:
    """Close a mapping; one still viewed by callers is left for the garbage collector."""
    view.release()
    try:
        mm.close()
    except BufferError:
        log.debug("shm mapping still viewed; it will be unmapped when the views are gone")
