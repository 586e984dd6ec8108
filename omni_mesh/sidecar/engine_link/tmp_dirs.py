"""The temp folders of engine processes (``TMPDIR`` of each engine: what its libraries write,
removed when the engine or its sidecar exits). Each is named after the sidecar that made it,
``omni-engine-s<stage>-p<sidecar pid>-…``, so that a pod starting on the host removes those of
pods that died with their engines (SIGKILL: neither could remove it). Shared-memory segments
an engine's libraries made and listed in its folder (``ENGINE_SEGMENTS_FILE``: vLLM's CPU
workers') go with it."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from omni_mesh.data_plane.constants import ENGINE_SEGMENTS_FILE
from omni_mesh.data_plane.shm_common import SHM_DIR

logger = logging.getLogger(__name__)

_NAME = re.compile(r"omni-engine-s\d+-p(\d+)-")


def make_engine_tmp(stage_id: int) -> str:
    """A fresh temp folder for this sidecar's engine."""
    return tempfile.mkdtemp(prefix=f"omni-engine-s{stage_id}-p{os.getpid()}-")


def sweep_orphaned_engine_tmp(root: str | None = None) -> list[str]:
    """Remove the engine temp folders under ``root`` (the temp dir) whose sidecar is gone;
    the folders removed."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob("omni-engine-s*-p*-*"):
        match = _NAME.match(path.name)
        if match is None or not path.is_dir() or _alive(int(match[1])):
            continue
        remove_engine_tmp(str(path))
        removed.append(str(path))
    if removed:
        logger.info("removed %d engine temp folders of dead pods: %s", len(removed), removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_engine_tmp(path: str) -> None:
    """Remove an engine's temp folder and the segments it lists (module docstring)."""
    listed = Path(path) / ENGINE_SEGMENTS_FILE
    try:
        names = listed.read_text().split()
    except OSError:
        names = []
    for name in names:
        if name.startswith("vllm_dist_") and "/" not in name:
            Path(SHM_DIR, name).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
