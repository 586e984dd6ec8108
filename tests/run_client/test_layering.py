"""The run client (``omni-run``) talks to pods over HTTP only: it may import configs, data_plane
and control_plane.client, never the pod (DESIGN §2)."""

from __future__ import annotations

from pathlib import Path

import pytest

import omni_mesh.run_client
from tests.layering import loaded_after_import, ours_outside

pytestmark = pytest.mark.unit

PACKAGE = Path(omni_mesh.run_client.__file__).parent
ALLOWED = (
    "omni_mesh.run_client",
    "omni_mesh.configs",
    "omni_mesh.data_plane",
    "omni_mesh.control_plane.client",
)


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_run_client_sources_import_only_what_design_allows(path: Path) -> None:
    assert not ours_outside(path, ALLOWED)


def test_omni_run_loads_no_pod_engine_or_launcher() -> None:
    loaded = loaded_after_import(["omni_mesh.run_client.cli"])
    bad = {
        m
        for m in loaded
        if m.startswith(("omni_mesh.sidecar", "omni_mesh.engines", "omni_mesh.launcher"))
    }
    assert not bad
