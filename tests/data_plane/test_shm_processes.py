"""Shared memory across real processes: a reader in a child, crashed writers, janitors."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from omni_mesh.data_plane import shm
from omni_mesh.data_plane.messages import ShmRef
from omni_mesh.data_plane.shm import ShmArena, ShmReader, sweep_orphans, unlink_prefix

from .children import READER, WRITER, read_json_line, start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NBYTES = 3 << 20
PIPES = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}


def _leftovers(directory: str, prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(prefix + "-"))


def _writer_info(proc: subprocess.Popen[str]) -> tuple[str, list[ShmRef]]:
    info = read_json_line(proc)
    prefix, refs = info["prefix"], info["refs"]
    assert isinstance(prefix, str) and isinstance(refs, list)
    return prefix, [ShmRef(segment=s, offset=o, nbytes=n) for s, o, n in refs]


def _wait_zombie(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not die")


def test_child_reads_what_the_parent_wrote() -> None:
    data = os.urandom(NBYTES)
    with ShmArena() as arena:
        slot = arena.alloc(NBYTES, "req-1")
        slot.view[:] = data
        ref = slot.ref
        args = [shm.SHM_DIR, ref.segment, str(ref.offset), str(ref.nbytes)]
        with start(READER, *args, stdout=subprocess.PIPE) as proc:
            assert proc.stdout is not None
            digest = proc.stdout.read().strip()
        assert proc.returncode == 0
        assert digest == hashlib.sha256(data).hexdigest()


def test_parent_reads_what_a_child_wrote_and_the_child_cleans_up() -> None:
    with start(WRITER, shm.SHM_DIR, str(NBYTES), "3", **PIPES) as proc:
        prefix, refs = _writer_info(proc)
        assert prefix.startswith(f"omni-{proc.pid}-")
        with ShmReader() as reader:
            for i, ref in enumerate(refs):
                view = reader.view(ref)
                assert view == bytes([i + 1]) * NBYTES
                view.release()
            assert proc.stdin is not None
            proc.stdin.close()
            assert proc.wait() == 0
    assert _leftovers(shm.SHM_DIR, prefix) == []


def test_kill9_leaks_until_unlink_prefix() -> None:
    with start(WRITER, shm.SHM_DIR, str(NBYTES), "2", **PIPES) as proc:
        prefix, refs = _writer_info(proc)
        with ShmReader() as reader:
            view = reader.view(refs[0])
            proc.kill()
            proc.wait()
            assert len(_leftovers(shm.SHM_DIR, prefix)) == 2  # what a crash leaves behind
            assert unlink_prefix(prefix) == 2
            assert _leftovers(shm.SHM_DIR, prefix) == []
            assert view == b"\x01" * NBYTES  # a live mapping outlives the unlink
            view.release()
            assert reader.prune() == 1 and len(reader) == 0


def test_kill9_then_sweep_orphans_removes_only_dead_owners(shm_dir: str) -> None:
    with ShmArena(directory=shm_dir) as mine:
        kept = mine.alloc(10, "req-1").ref.segment
        with start(WRITER, shm_dir, "10", "2", **PIPES) as proc:
            prefix, _ = _writer_info(proc)
            proc.kill()
            proc.wait()
        assert len(_leftovers(shm_dir, prefix)) == 2
        assert sweep_orphans(directory=shm_dir) == 2
        assert os.listdir(shm_dir) == [kept]
    assert os.listdir(shm_dir) == []


def test_sweep_treats_an_unreaped_child_as_dead(shm_dir: str) -> None:
    with start(WRITER, shm_dir, "10", "1", **PIPES) as proc:
        prefix, _ = _writer_info(proc)
        proc.kill()
        _wait_zombie(proc.pid)
        assert sweep_orphans(directory=shm_dir) == 1
        assert _leftovers(shm_dir, prefix) == []
        proc.wait()
