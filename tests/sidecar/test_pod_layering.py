"""The pod (``sidecar/``) may import configs, data_plane, control_plane.client and
observability; it starts its engine as a process and never imports the launcher or the run
client (DESIGN §2).

Inside, the pod's top level is its lifecycle and what every part shares (the ``Pod``, the
stage runner, errors, deadlines); its parts are subpackages named by job, and imports go one
way only, no circle between any two files (tests/test_import_circles.py):

    app, cli_stage (the composition)
      -> api/ (every route the pod serves: OpenAI, /v1/run, realtime, and /v1/hop for peers)
        -> admission/ (queue, gate, a request's class and slot, early shedding, outcomes,
           the load its heartbeats report)
          -> the shared top level (pod, runner, errors, deadlines, appkeys, inputs, middleware)
            -> hop/ (the outbound hop: client, connections, router, liveness, sheds) and
               engine_link/ (the engine's client and a stage input's outputs)

The one upward arrow is the pod holding its admission gate (``admission.gate``, which itself
reads only the queue, the errors and the shed wire form)."""

from __future__ import annotations

from pathlib import Path

import pytest

import omni_mesh.sidecar
from tests.layering import module_graph, ours_outside, wrong_way

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
NAME = "omni_mesh.sidecar"
ROOTS = {f"{NAME}.app", f"{NAME}.cli_stage"}
#: part -> the parts it may import (besides itself)
DIRECTIONS: dict[str, set[str]] = {
    "api": {"admission", "shared", "hop", "engine_link"},
    "admission": {"shared", "hop"},
    "shared": {"hop", "engine_link", "admission.gate"},
    "hop": set(),
    "engine_link": set(),
}


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_pod_sources_import_only_what_design_allows(path: Path) -> None:
    assert not ours_outside(path, ALLOWED)


def test_the_pods_parts_import_one_way() -> None:
    assert wrong_way(module_graph(PACKAGE, NAME), NAME, DIRECTIONS, ROOTS) == []


def test_the_parts_are_folders_and_the_top_level_is_the_lifecycle() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert top == [
        "app", "appkeys", "cli_stage", "deadlines", "errors", "gc_pacer", "inputs", "middleware",
        "pod", "runner",
    ]  # fmt: skip
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == set(
        DIRECTIONS
    ) - {"shared"}
