"""The engine protocol: what a stage's model code implements.

An engine is pure model execution. It never sees sockets, shared memory, HTTP or Redis: the
host loop (``engines/host.py``) hands it a batch of :class:`EngineRequest` (tensors already
resolved to numpy arrays) and turns its :class:`EngineResult` list into outputs and next-stage
inputs. Lifecycle: ``__init__(ctx)`` (cheap) → ``load()`` (weights) → ``execute(batch)``
repeatedly → ``close()``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_mesh.data_plane.messages import SamplingParams, Scalar

if TYPE_CHECKING:
    from omni_mesh.configs.deploy import StageDeployConfig
    from omni_mesh.configs.pipeline import PipelineSpec, StageSpec


class EngineInputError(ValueError):
    """A request's input is unusable by this engine (a missing tensor, a wrong shape).
    Reported to the client as a 400 naming the stage; the engine keeps serving."""


class OutputCapacityError(RuntimeError):
    """No room for a request's outputs right now (shared memory full). The request fails as
    ``unavailable`` (503, Retry-After); the engine keeps serving."""


@dataclass
class StageData:
    """Named scalars and named arrays: a stage's output, or the input a processor builds."""

    fields: dict[str, Scalar] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


@dataclass
class EngineRequest:
    """One request for one execution. ``data`` holds the stage's input; for the entry stage
    ``data.fields`` holds the client's prompt fields (``prompt``, ``voice``, ``size``, …)."""

    request_id: str
    seed: int
    data: StageData
    sampling: SamplingParams | None = None


@dataclass
class EngineResult:
    """An engine's answer for one request.

    ``output`` feeds the downstream stages (through their processors); ``final`` is this
    stage's contribution to the client's answer (only for stages with a ``final_output``);
    ``error`` makes it a failed request (as data: the engine keeps serving)."""

    request_id: str
    output: StageData = field(default_factory=StageData)
    final: StageData | None = None
    error: str | None = None


@dataclass(frozen=True)
class EngineContext:
    """What an engine is told about where it runs."""

    pipeline: PipelineSpec
    stage: StageSpec
    config: StageDeployConfig
    device: str = "cpu"


class StageEngine(ABC):
    """Base class of every stage engine."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def load(self) -> None:
        """Build or load weights. May take seconds; runs before READY."""

    @abstractmethod
    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        """Run one batch; return one result per request, in any order. Deterministic for a
        request's seed whatever else is in the batch."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; called once on shutdown."""


Processor = Callable[[StageData], StageData]


def import_object(path: str) -> Any:
    """Resolve ``"package.module:attr"``; raises ImportError/AttributeError naming the path."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{module_name!r} has no attribute {attr!r} (from {path!r})") from None
