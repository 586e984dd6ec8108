"""Helpers for the layering tests (DESIGN §2): what a package's sources import, and which of
our modules a fresh interpreter has loaded after importing some entry modules."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path


def imports_of(path: Path) -> set[str]:
    """Every module named by an ``import`` or ``from … import`` in ``path``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def ours_outside(path: Path, allowed: Iterable[str]) -> set[str]:
    """The omni_mesh modules ``path`` imports that are neither in nor under ``allowed``."""
    prefixes = tuple(allowed)
    return {
        n
        for n in imports_of(path)
        if n.split(".")[0] == "omni_mesh"
        and not any(n == p or n.startswith(p + ".") for p in prefixes)
    }


def loaded_after_import(modules: Iterable[str]) -> set[str]:
    """``sys.modules`` of a fresh interpreter after importing ``modules``."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout))
