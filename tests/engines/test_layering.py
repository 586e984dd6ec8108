"""engines/ is model execution only: it never imports aiohttp, redis, the sidecar or the
control plane (DESIGN §2). Checked on the source and in a fresh interpreter.

Its folders (issue #32): one per model family (``qwen3_omni``, ``csm``, ``glm_image``) beside
folders named by the job they share, and the engine host and protocol at the top level:

    qwen3_omni/, csm/, glm_image/ (a family: its stages, tiny builder, processors)
      -> vllm/ (the generic vLLM adapter a family's vLLM stage builds on)
      -> batching/ (the batched decode over transformers, a split stage's side of it)
        -> kv/ (a split stage's state exchange: NIXL agents, buffers, pulls, counters)
        -> hf/ (Hugging Face folders: resolving, loading a stage's part, tiny tokenizers)
      vllm/ (the generic vLLM adapter) -> kv/, hf/, reference/ (tiny-omni-vllm's codec)
      reference/ (the fabric's fixtures: tiny-omni, tiny-tts, tiny-image)
        -> the top level (protocol, host loop, process, fields, extras, torch engine, seeds)

A family never imports another family, and the top level imports none of the folders.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import omni_mesh.engines
from tests.layering import module_graph, wrong_way

pytestmark = pytest.mark.unit

NAME = "omni_mesh.engines"
ROOTS = {f"{NAME}.__main__"}
FAMILIES = ("qwen3_omni", "csm", "glm_image")
SHARED = {"batching", "kv", "hf", "vllm", "reference"}
DIRECTIONS: dict[str, set[str]] = {
    **{family: {"batching", "kv", "hf", "vllm", "shared"} for family in FAMILIES},
    "batching": {"kv", "hf", "shared"},
    "kv": {"shared"},
    "hf": {"shared"},
    "vllm": {"kv", "hf", "reference.codec", "shared"},
    "reference": {"shared"},
    "shared": set(),
}

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


def test_the_engines_folders_import_one_way() -> None:
    assert wrong_way(module_graph(ENGINES, NAME), NAME, DIRECTIONS, ROOTS) == []


def test_the_folders_are_the_families_and_the_shared_parts() -> None:
    folders = {p.name for p in ENGINES.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(FAMILIES) | SHARED


def test_a_family_importing_another_is_seen(tmp_path: Path) -> None:
    for folder in ("qwen3_omni", "csm"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "base.py").write_text("")
    (tmp_path / "csm" / "talker.py").write_text("from omni_mesh.engines.base import x\n")
    (tmp_path / "qwen3_omni" / "talker.py").write_text(
        "from omni_mesh.engines.csm.talker import y\n"
    )
    assert wrong_way(module_graph(tmp_path, NAME), NAME, DIRECTIONS, ROOTS) == [
        f"{NAME}.qwen3_omni.talker (qwen3_omni) -> {NAME}.csm.talker (csm)"
    ]
