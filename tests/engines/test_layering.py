"""engines/ is model execution only: it never imports aiohttp, redis, the sidecar or the
control plane (DESIGN §2). Checked on the source and in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import omni_mesh.engines

pytestmark = pytest.mark.unit

FORBIDDEN = ("aiohttp", "redis", "omni_mesh.sidecar", "omni_mesh.control_plane")
ENGINES = Path(omni_mesh.engines.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(ENGINES.rglob("*.py")), ids=lambda p: p.name)
def test_engine_sources_import_nothing_forbidden(path: Path) -> None:
    bad = {n for n in _imports(path) for f in FORBIDDEN if n == f or n.startswith(f + ".")}
    assert not bad, f"{path} imports {sorted(bad)}"


def test_an_engine_process_loads_no_network_stack() -> None:
    code = (
        "import sys, omni_mesh.engines.__main__, omni_mesh.engines.process, "
        "omni_mesh.engines.synthetic, omni_mesh.engines.reference.thinker; "
        "bad = [m for m in sys.modules if m.split('.')[0] in {'aiohttp', 'redis'} "
        "or m.startswith(('omni_mesh.sidecar', 'omni_mesh.control_plane'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
