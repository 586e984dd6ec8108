"""The engine protocol: what a stage's model code implements.

An engine is pure model execution. It never sees sockets, shared memory, HTTP or Redis: the
host loop (``engines/host.py``) hands it a batch of :class:`EngineRequest` (tensors already
resolved to numpy arrays) and turns its :class:`EngineResult` list into outputs and next-stage
inputs. Lifecycle: ``__init__(ctx)`` (cheap) → ``load()`` (weights) → ``execute(batch)`` or
``open(batch)`` repeatedly → ``close()``.

Streams (``async_chunk``). The core drives an engine through :meth:`StageEngine.open`: one
iterator of results per request, in the batch's order. Each ``next()`` produces the request's
next chunk; a result with ``last=True`` (or an ``error``) ends the stream, and ending without one
is an engine error. A stream may also yield ``None``: no result this step, ask again at the next
(an engine with its own scheduler, vLLM, or one that batches its requests, the transformers
talkers, whose request has no output yet); the request then
stays running. The core keeps the streams it has opened across its steps (continuous batching
at chunk granularity): every step it calls :meth:`StageEngine.before_step` once with the number
of streams it is about to advance, then ``next()`` once on each, and closes a stream
(``close()`` on a generator) that is aborted or expires. A stream may do its compute in
``open`` (the default: ``execute`` runs there, the iterators only hand the results out) or
lazily in each ``next()`` (the reference engines), where an exception fails only its request.

An engine should stream only when ``ctx.async_chunk`` is on and the request's input is whole
(:attr:`EngineRequest.whole`) or streamed (:attr:`EngineRequest.streamed_input`: a stage whose
spec has ``stream_input`` takes its source's chunks as one request whose ``data`` grows; see
``engines/fed.py``); for a chunk of an upstream stream it gives exactly one result.
The core numbers the outputs (see ``engines/core.py``), so results carry no chunk index.
Several chunks of one request may sit in one batch: ``request_id`` is then not unique, and
``execute`` must return their results in the batch's order.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from omni_mesh.data_plane.messages import EngineStats, SamplingParams, Scalar
from omni_mesh.engines.moved import current_module

if TYPE_CHECKING:
    from omni_mesh.configs.deploy import StageDeployConfig
    from omni_mesh.configs.pipeline_spec import PipelineSpec, StageSpec


class EngineInputError(ValueError):
    """A request's input is unusable by this engine (a missing tensor, a wrong shape).
    Reported to the client as a 400 naming the stage; the engine keeps serving."""


class EngineConfigError(ValueError):
    """The stage's engine settings (``engine_extras``) are unusable: the stage cannot start.
    Reported as one line; ``omni-stage`` exits 2, as for any other bad setting."""


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
    ``data.fields`` holds the client's prompt fields (``prompt``, ``voice``, ``size``, …).

    ``chunk`` / ``last`` say which piece of an upstream stream the input is: a whole input is
    chunk 0 with ``last=True``."""

    request_id: str
    seed: int
    data: StageData
    sampling: SamplingParams | None = None
    chunk: int = 0
    last: bool = True
    kv_transfer: str = ""  # a split stage's KV hand-off (data_plane/kv_transfer.py)
    #: A streamed input (the stage's spec has ``stream_input``): the request was opened on its
    #: first chunk, ``data`` grows in place as later chunks arrive (``engines/fed.py``) and
    #: ``last`` turns True with the final one. Its engine may stream, as for a whole input.
    streamed_input: bool = False

    @property
    def whole(self) -> bool:
        """The input is complete (not one chunk of an upstream stream): the engine may stream."""
        return self.chunk == 0 and self.last

    @property
    def streams_out(self) -> bool:
        """The engine may answer with a stream of chunks: a whole input, or a streamed one."""
        return self.whole or self.streamed_input


@dataclass
class EngineResult:
    """An engine's answer for one request.

    ``output`` feeds the downstream stages (through their processors); ``final`` is this
    stage's contribution to the client's answer (only for stages with a ``final_output``);
    ``error`` makes it a failed request (as data: the engine keeps serving). In a stream,
    ``last=False`` says more chunks follow for this request; ``forward=False`` keeps a chunk
    for the client alone (no next-stage input: ``engines/core.py``), and a last result is
    always forwarded."""

    request_id: str
    output: StageData = field(default_factory=StageData)
    final: StageData | None = None
    error: str | None = None
    last: bool = True
    forward: bool = True
    kv_transfer: str = ""  # a prefill request's answer: vLLM's params of its KV blocks


@dataclass(frozen=True)
class EngineContext:
    """What an engine is told about where it runs."""

    pipeline: PipelineSpec
    stage: StageSpec
    config: StageDeployConfig
    #: Where the model runs: "cuda" when the stage lists ``devices`` (the process sees only
    #: its replica's slice, as cuda:0, …), else "cpu". Engines on torch place their weights
    #: and inputs there (``engines/devices.py``); vLLM reads the visible devices itself.
    device: str = "cpu"
    async_chunk: bool = False  # the pipeline streams chunks between stages (engines may stream)


class StageEngine(ABC):
    """Base class of every stage engine."""

    #: Whether the engine runs a split stage's prefill and decode requests (deploy
    #: ``prefill:``, ``data_plane/kv_transfer.py``): the vLLM engine and the qwen3-omni thinker do.
    splits_prefill: ClassVar[bool] = False
    #: Seconds of audio one engine step makes for each running stream (a talker's codec frame),
    #: 0 where a step is not an audio frame. The sidecar reports this over the step's time as
    #: the stage's stream real-time factor (``omni_stage_stream_realtime_factor``).
    step_audio_s: ClassVar[float] = 0.0

    @classmethod
    def engine_for(cls, ctx: EngineContext) -> type[StageEngine]:
        """The class that runs the stage: this one, unless the stage's settings pick another
        (qwen3-omni's thinker runs on transformers or on vLLM by ``engine_extras.backend``).
        Called before the engine is made; raise :class:`EngineConfigError` for a bad choice."""
        return cls

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        if ctx.config.prefill is not None and not self.splits_prefill:
            raise EngineConfigError(
                f"stage {ctx.stage.stage_id} ({ctx.stage.name}): prefill: splits a stage into "
                f"prefill and decode pools, which {type(self).__name__} does not do (vLLM "
                "stages and the qwen3-omni thinker do)"
            )

    @abstractmethod
    def load(self) -> None:
        """Build or load weights. May take seconds; runs before READY."""

    @abstractmethod
    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        """Run one batch; return one result per request, in any order. Deterministic for a
        request's seed whatever else is in the batch."""

    def open(self, batch: Sequence[EngineRequest]) -> Sequence[Iterator[EngineResult | None]]:
        """Start one stream of results per request, in the batch's order (module docstring).

        The default runs :meth:`execute` now and hands each result out as a one-item stream
        (an empty stream for a request ``execute`` left out). Exceptions raised here fail the
        whole batch, as those of ``execute`` do."""
        pending: dict[str, list[EngineResult]] = {}
        for result in self.execute(batch):
            pending.setdefault(result.request_id, []).append(result)
        streams: list[Iterator[EngineResult | None]] = []
        for request in batch:  # results of one request id are handed out in order
            results = pending.get(request.request_id)
            streams.append(iter([results.pop(0)] if results else []))
        return streams

    def idle(self) -> None:  # noqa: B027 - optional hook
        """Called whenever the engine process has nothing to run (after each look at its
        channel, which waits up to the stats interval while idle): housekeeping a model
        engine's own scheduler needs without requests."""

    def before_step(self, streams: int) -> None:  # noqa: B027 - optional hook
        """Called once per core step, just before ``streams`` streams are advanced by one
        ``next()`` each. An engine that models a per-step cost (the synthetic one) spends it
        here."""

    def waits_for_input(self) -> bool:
        """True when no running request can go on before more of a streamed input arrives
        (``EngineRequest.streamed_input``): the engine process then waits on its channel
        instead of stepping in a busy loop."""
        return False

    def holds_work(self) -> bool:
        """True while the engine keeps something others will still fetch though no request
        runs (a split stage's prefill states, until pulled or expired): a draining engine
        process waits for it before it stops."""
        return False

    def stats(self) -> EngineStats | None:
        """The engine's own scheduler view (running, waiting, KV cache, tokens/s), for an engine
        that batches by itself (vLLM); None for the others. Called with every stats report."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; called once on shutdown."""


Processor = Callable[[StageData], StageData]


def import_object(path: str) -> Any:
    """Resolve ``"package.module:attr"``; raises ImportError/AttributeError naming the path. A
    built-in module that moved is found under its old name too (with a DeprecationWarning)."""
    module_name, _, attr = path.partition(":")
    module_name = current_module(module_name)
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{module_name!r} has no attribute {attr!r} (from {path!r})") from None
