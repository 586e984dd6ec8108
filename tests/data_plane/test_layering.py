"""data_plane imports only configs of ours, and only wire.py imports aiohttp (engines import
the rest of the package and must stay free of HTTP)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import omni_mesh.data_plane as dp

PACKAGE = Path(dp.__file__).parent
ENGINE_SIDE = ["messages", "codec", "shm", "channel", "tensors", "signing", "envelope"]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.unit
@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_imports(path: Path) -> None:
    imports = _imports(path)
    ours = {i for i in imports if i.startswith("omni_mesh")}
    allowed = ("omni_mesh.data_plane", "omni_mesh.configs")
    assert all(i.startswith(allowed) for i in ours), ours
    if path.name != "wire.py":
        assert not any(i.split(".")[0] == "aiohttp" for i in imports)
    assert "pickle" not in {i.split(".")[0] for i in imports}


@pytest.mark.integration
def test_engine_side_modules_do_not_load_aiohttp() -> None:
    modules = ", ".join(f"omni_mesh.data_plane.{m}" for m in ENGINE_SIDE)
    code = f"import sys, {modules}; sys.exit('aiohttp' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0
