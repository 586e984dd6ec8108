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


def module_graph(package: Path, name: str) -> dict[str, set[str]]:
    """The package's modules (dotted, under ``name``) and the package's modules each imports
    (``from x import y`` counts ``x.y`` where that is a module)."""
    modules: dict[str, Path] = {}
    for path in package.rglob("*.py"):
        parts = (name, *path.relative_to(package).with_suffix("").parts)
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[dotted] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                named = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[module].update(n for n in named if n in modules and n != module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def wrong_way(
    graph: dict[str, set[str]], name: str, directions: dict[str, set[str]], roots: set[str]
) -> list[str]:
    """The imports of package ``name`` that go against ``directions`` (part -> the parts it
    may import; a part is a subpackage, everything else at the top level is ``"shared"``; an
    entry may also name one module, ``"admission.gate"``). Nothing may import a root (the
    modules that put the package together)."""

    def part_of(module: str) -> str:
        first = module.removeprefix(name).lstrip(".").split(".")[0]
        return first if first in directions else "shared"

    wrong = []
    for module, imported in sorted(graph.items()):
        if module in roots or module == name:
            continue
        part = part_of(module)
        for other in sorted(imported):
            there = part_of(other)
            if other in roots:
                wrong.append(f"{module} -> {other} (a root)")
            elif there != part and not {there, other.removeprefix(f"{name}.")} & directions[part]:
                wrong.append(f"{module} ({part}) -> {other} ({there})")
    return wrong
