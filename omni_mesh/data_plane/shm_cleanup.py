"""Janitors of the shared-memory arena, for processes that crashed: :func:`unlink_prefix`
removes one arena's (or one pid's) segments, :func:`sweep_orphans` those of dead processes."""

from __future__ import annotations

import os
import re

from omni_mesh.data_plane.shm_common import check_name, log, resolve_directory

_ORPHAN = re.compile(r"^omni-(?P<pid>\d+)-")
# A pid whose process started this long after a segment was last changed cannot own it.
_PID_REUSE_MARGIN_S = 2.0


def unlink_prefix(prefix: str, *, directory: str | None = None) -> int:
    """Unlink every segment named ``{prefix}-…`` (an arena's, or every arena of a pid with
    ``omni-{pid}``); returns how many. Used when an engine process died."""
    check_name(prefix, "prefix")
    root = resolve_directory(directory)
    count = 0
    for entry in os.scandir(root):
        if entry.name.startswith(prefix + "-") and _unlink(root, entry.name):
            count += 1
    if count:
        log.info("shm unlinked prefix=%s segments=%d", prefix, count)
    return count


def sweep_orphans(*, directory: str | None = None) -> int:
    """Unlink ``omni-{pid}-…`` segments whose creating process is gone (dead, a zombie, or
    its pid reused by a newer process); returns how many. Safe to run at any time."""
    root = resolve_directory(directory)
    count = 0
    for entry in os.scandir(root):
        match = _ORPHAN.match(entry.name)
        if match is None or int(match["pid"]) == os.getpid():
            continue
        try:
            changed = entry.stat().st_ctime
        except FileNotFoundError:
            continue
        if not _owner_alive(int(match["pid"]), changed) and _unlink(root, entry.name):
            count += 1
    if count:
        log.warning("shm swept orphaned segments=%d dir=%s", count, root)
    return count


def _unlink(root: str, name: str) -> bool:
    try:
        os.unlink(os.path.join(root, name))
    except FileNotFoundError:
        return False
    return True


def _owner_alive(pid: int, changed: float) -> bool:
    """Whether process ``pid`` is alive and old enough to have created a file last changed at
    ``changed`` (epoch seconds)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith(b"btime"))
    except (OSError, IndexError, StopIteration, ValueError):
        return True  # no procfs details: trust kill(0)
    if fields[0] == b"Z":
        return False
    started = btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= changed + _PID_REUSE_MARGIN_S
