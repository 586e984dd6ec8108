"""The control plane's folders and the direction of its imports (issue #20): no circle between
its files (tests/test_import_circles.py), and

    app, server, cli, __main__ (the composition)
      -> api/ (the HTTP routes, watch and its hub, middlewares, input parsing, app keys)
        -> liveness/ (the sweeper, the suspect probe)
          -> autoscaling/ (the pure policy, the loop around it)
            -> store/ (Redis: the key schema, instances, scale, sessions, Lua scripts)
              -> the shared top level (schema, errors, session schema, tasks, status, Redis
                 connections, the embedded Redis)

``client/`` (what the pods and omni-up use) reads only the shared top level: a pod never loads
the server's parts."""

from __future__ import annotations

from pathlib import Path

import pytest

import omni_mesh.control_plane
from tests.layering import module_graph, wrong_way

pytestmark = pytest.mark.unit

PACKAGE = Path(omni_mesh.control_plane.__file__).parent
NAME = "omni_mesh.control_plane"
ROOTS = {f"{NAME}.{m}" for m in ("app", "server", "cli", "__main__")}
DIRECTIONS: dict[str, set[str]] = {
    "api": {"liveness", "autoscaling", "store", "shared"},
    "liveness": {"autoscaling", "store", "shared"},
    "autoscaling": {"store", "shared"},
    "store": {"shared"},
    "client": {"shared"},
    "shared": set(),
}


def test_the_control_planes_parts_import_one_way() -> None:
    assert wrong_way(module_graph(PACKAGE, NAME), NAME, DIRECTIONS, ROOTS) == []


def test_the_parts_are_folders() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(DIRECTIONS) - {"shared"}
