"""No circle between the files of a package (the house rule of issue #20): a circle means
two files that cannot be read, tested or moved apart. Type-only imports count too."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import omni_mesh
from tests.layering import circles, module_graph, wrong_way

pytestmark = pytest.mark.unit

PACKAGES = [
    "omni_mesh.configs",
    "omni_mesh.control_plane",
    "omni_mesh.data_plane",
    "omni_mesh.engines",
    "omni_mesh.launcher",
    "omni_mesh.observability",
    "omni_mesh.run_client",
    "omni_mesh.sidecar",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_no_circle_between_a_packages_files(name: str) -> None:
    package = importlib.import_module(name)
    assert package.__file__ is not None
    assert circles(module_graph(Path(package.__file__).parent, name)) == []


def test_no_circle_anywhere_in_omni_mesh() -> None:
    """Across packages too, imports inside functions included (issue #32)."""
    root = Path(omni_mesh.__file__).parent
    assert circles(module_graph(root, "omni_mesh")) == []


def test_the_checks_see_a_circle_and_a_wrong_way_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("import pkg.a\n")
    (tmp_path / "c.py").write_text("from pkg.b import x\n")
    graph = module_graph(tmp_path, "pkg")
    assert graph["pkg.c"] == {"pkg.b"}
    assert circles(graph) == [["pkg.a", "pkg.b"]]
    (tmp_path / "low").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "low" / "x.py").write_text("from pkg import c\n")
    graph = module_graph(tmp_path, "pkg")
    assert wrong_way(graph, "pkg", {"low": set()}, set()) == ["pkg.low.x (low) -> pkg.c (shared)"]
    assert wrong_way(graph, "pkg", {"low": {"shared"}}, {"pkg.c"}) == [
        "pkg.low.x -> pkg.c (a root)"
    ]
