"""The launcher (``omni-up``) starts pods as processes and never imports them: it may import
configs, control_plane.client, observability and the shared-memory janitor (DESIGN §2)."""

from __future__ import annotations

from pathlib import Path

import pytest

import omni_mesh.launcher
from tests.layering import loaded_after_import, ours_outside

pytestmark = pytest.mark.unit

PACKAGE = Path(omni_mesh.launcher.__file__).parent
ALLOWED = (
    "omni_mesh.launcher",
    "omni_mesh.configs",
    "omni_mesh.control_plane.client",
    "omni_mesh.observability",
    "omni_mesh.procutil",
    "omni_mesh.data_plane.shm_cleanup",  # the host's /dev/shm janitor, after the pods are gone
)


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_launcher_sources_import_only_what_design_allows(path: Path) -> None:
    assert not ours_outside(path, ALLOWED)


def test_omni_up_loads_no_pod_engine_or_run_client() -> None:
    loaded = loaded_after_import(["omni_mesh.launcher.cli"])
    bad = {
        m
        for m in loaded
        if m.startswith(("omni_mesh.sidecar", "omni_mesh.engines", "omni_mesh.run_client"))
    }
    assert not bad
