"""The pod (``sidecar/``) may import configs, data_plane, control_plane.client and
observability; it starts its engine as a process and never imports the launcher or the run
client (DESIGN §2)."""

from __future__ import annotations

from pathlib import Path

import pytest

import omni_mesh.sidecar
from tests.layering import ours_outside

pytestmark = pytest.mark.unit

PACKAGE = Path(omni_mesh.sidecar.__file__).parent
ALLOWED = (
    "omni_mesh.sidecar",
    "omni_mesh.configs",
    "omni_mesh.data_plane",
    "omni_mesh.control_plane.client",
    "omni_mesh.observability",
    "omni_mesh.procutil",
)


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_pod_sources_import_only_what_design_allows(path: Path) -> None:
    assert not ours_outside(path, ALLOWED)
