"""The registry of pipelines by name: the built-in ones (:mod:`omni_mesh.configs.pipelines`)
from the start, and users' own, registered at import by the modules named with
``--pipeline-module`` / ``$OMNI_PIPELINE_MODULES`` or by installed packages' entry points
(``omni_mesh.pipelines``)."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from omni_mesh.configs import pipelines
from omni_mesh.configs.pipeline_spec import PipelineError, PipelineSpec, UnknownPipelineError

# ---- registry --------------------------------------------------------------------------------

_REGISTRY: dict[str, PipelineSpec] = {p.name: p for p in pipelines.BUILTIN_PIPELINES}
#: pipeline name -> the module whose code registered it
_ORIGIN: dict[str, str] = dict.fromkeys(_REGISTRY, pipelines.__name__)


def register_pipeline(spec: PipelineSpec, *, replace: bool = False) -> PipelineSpec:
    """Add a pipeline to the registry; a second registration of one name is an error."""
    if spec.name in _REGISTRY and not replace:
        raise PipelineError(f"pipeline {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    _ORIGIN[spec.name] = str(sys._getframe(1).f_globals.get("__name__", ""))
    return spec


def get_pipeline(name: str) -> PipelineSpec:
    """The registered pipeline called ``name``; :class:`UnknownPipelineError` otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownPipelineError(
            f"unknown pipeline {name!r} (registered: {', '.join(sorted(_REGISTRY))})"
        ) from None


def list_pipelines() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


# ---- users' own pipelines ----------------------------------------------------------------------

#: Comma-separated modules that register pipelines, read by every CLI (and inherited by the
#: engine process, which imports the same modules).
PIPELINE_MODULES_ENV = "OMNI_PIPELINE_MODULES"
#: Installed packages register pipelines through this entry-point group: each entry names a
#: module (``my_pkg.pipelines``), imported for its ``register_pipeline`` calls, or a
#: ``module:function`` called with no arguments.
ENTRY_POINT_GROUP = "omni_mesh.pipelines"

_LOADED: dict[str, tuple[str, ...]] = {}  # module (or entry point) -> the pipelines it registered


class PipelineModuleError(PipelineError):
    """A ``--pipeline-module`` (or entry point) failed to import or registered no pipeline."""


def pipeline_modules_from(flags: Sequence[str] | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """The modules to import: the ``--pipeline-module`` flags when given, else
    ``$OMNI_PIPELINE_MODULES`` (flags beat the environment, as every other setting)."""
    items = list(flags) if flags else env.get(PIPELINE_MODULES_ENV, "").split(",")
    out: list[str] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", item) is None:
            raise PipelineModuleError(f"--pipeline-module {item!r}: not a Python module name")
        if item not in out:
            out.append(item)
    return tuple(out)


def load_pipeline_modules(
    modules: Sequence[str] = (), *, entry_points: bool = True
) -> tuple[str, ...]:
    """Import ``modules`` (and the ``omni_mesh.pipelines`` entry points) so that they register
    their pipelines; return the names registered. A module that fails to import, or registers
    no pipeline, raises :class:`PipelineModuleError` naming it (one line)."""
    names: list[str] = []
    for module in modules:
        names += _load_one(module, partial(importlib.import_module, module), module)
    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            names += _load_one(f"entry point {ep.name} = {ep.value}", partial(_run_ep, ep))
    return tuple(names)


def _run_ep(ep: importlib.metadata.EntryPoint) -> None:
    loaded = ep.load()
    if callable(loaded):
        loaded()


def _load_one(label: str, load: Callable[[], object], module: str = "") -> tuple[str, ...]:
    if label in _LOADED:
        return _LOADED[label]
    before = set(_REGISTRY)
    try:
        load()
    except PipelineError as exc:
        raise PipelineModuleError(f"pipeline module {label}: {exc}") from None
    except Exception as exc:  # an import error, or any error raised by the module's code
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PipelineModuleError(
            f"pipeline module {label}: failed to import: {type(exc).__name__}: {detail}"
        ) from None
    # New names, and those the module (or its submodules) registered before, imported earlier.
    mine = {n for n, origin in _ORIGIN.items() if module and f"{origin}.".startswith(f"{module}.")}
    added = tuple(sorted((set(_REGISTRY) - before) | mine))
    if not added:
        raise PipelineModuleError(
            f"pipeline module {label}: registered no pipeline "
            "(call omni_mesh.api.register_pipeline at import)"
        )
    _LOADED[label] = added
    return added
