"""Engine temp folders (``sidecar/engine_link/tmp_dirs.py``): named after their sidecar's pid;
a starting pod removes those whose sidecar is gone (a pod killed with its engine), and leaves
live pods' folders and anything else alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_mesh.sidecar.engine_link.tmp_dirs import make_engine_tmp, sweep_orphaned_engine_tmp

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_the_folders_of_dead_sidecars_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    mine = Path(make_engine_tmp(3))
    assert mine.parent == tmp_path and mine.name.startswith(f"omni-engine-s3-p{os.getpid()}-")
    dead = tmp_path / f"omni-engine-s0-p{_dead_pid()}-abcd"
    (dead / "torch").mkdir(parents=True)
    (dead / "torch" / "kernel.so").write_bytes(b"x")
    older = tmp_path / "omni-engine-s0-abcd"  # a name without a pid: not ours to judge
    older.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()
    assert sweep_orphaned_engine_tmp() == [str(dead)]
    assert not dead.exists() and mine.exists() and older.exists() and other.exists()
    assert sweep_orphaned_engine_tmp(str(tmp_path)) == []
