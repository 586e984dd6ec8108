"""No circle between the files of a package (the house rule of issue #20): a circle means
two files that cannot be read, tested or moved apart. Type-only imports count too."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.layering import circles, module_graph

pytestmark = pytest.mark.unit

PACKAGES = [
    "omni_mesh.configs",
    "omni_mesh.control_plane",
    "omni_mesh.observability",
    "omni_mesh.run_client",
    "omni_mesh.sidecar",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_no_circle_between_a_packages_files(name: str) -> None:
    package = importlib.import_module(name)
    assert package.__file__ is not None
    assert circles(module_graph(Path(package.__file__).parent, name)) == []
