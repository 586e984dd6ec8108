"""Fixtures of the data-plane tests: leak checks on /dev/shm, isolated segment directories,
a deployment secret and a pipeline."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.configs.pipelines import TINY_OMNI
from omni_mesh.data_plane import shm

SHM_ROOT = Path(shm.SHM_DIR)


def own_segments() -> set[str]:
    """Segments in /dev/shm created by this test process."""
    prefix = f"omni-{os.getpid()}-"
    return {p.name for p in SHM_ROOT.iterdir() if p.name.startswith(prefix)}


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    """Fail a test that leaves a segment of this process in /dev/shm (and remove it)."""
    before = own_segments()
    yield
    leaked = own_segments() - before
    for name in leaked:
        (SHM_ROOT / name).unlink(missing_ok=True)
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private tmpfs directory for segments (janitor tests must not touch other users'
    /dev/shm entries); it must be empty at the end of the test."""
    path = SHM_ROOT / f"pytest-dp-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    try:
        yield str(path)
        left = sorted(p.name for p in path.iterdir())
        assert not left, f"segments left in {path}: {left}"
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def secret() -> bytes:
    return b"test-deployment-secret-0123456789"


@pytest.fixture
def pipeline() -> PipelineSpec:
    return TINY_OMNI
