"""What every torch engine shares: the execute loop, one request at a time.

:class:`TorchEngine` validates a whole batch first: a bad request gets an error result (the
message of an :class:`EngineInputError` naming the stage, the request and the field) before any
compute is spent, and the others run as usual. Each request runs on its own under
``torch.inference_mode()`` with a generator seeded from the request's seed alone, so its output
does not depend on what else is in its batch. Weights are seeded from the pipeline and stage
names, so every replica holds the same model.

Streams (``open``): the compute runs lazily, one chunk per ``next()``, each ``next()`` under its
own ``torch.inference_mode()`` (never left entered between the core's steps), so an exception
fails its request alone. A request streams (:meth:`TorchEngine.run_chunks`) only when
``ctx.async_chunk`` is on and its input is whole; otherwise its stream is one :meth:`run`.

The reference engines (``engines/reference``) build on it, and so do the real families' stages
that run one request at a time (a code2wav) or batch their rows themselves
(``engines/batching``).
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar, cast

import torch

from omni_mesh.engines.base import (
    EngineContext,
    EngineInputError,
    EngineRequest,
    EngineResult,
    StageEngine,
)
from omni_mesh.engines.fields import FieldReader
from omni_mesh.engines.seeds import derive_seed, make_generator

logger = logging.getLogger(__name__)

InputT = TypeVar("InputT")


class TorchEngine(StageEngine, Generic[InputT]):
    """Base of the torch engines: ``parse`` validates one request (no compute), ``build``
    makes the model from a weight seed, ``run`` executes one parsed request."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.where = f"stage {ctx.stage.name!r} ({ctx.pipeline.name} stage {ctx.stage.stage_id})"
        self.weight_seed = derive_seed("omni-mesh-weights", ctx.pipeline.name, ctx.stage.name)
        self._loaded = False

    @property
    def is_entry(self) -> bool:
        return not self.ctx.stage.sources

    def load(self) -> None:
        started = time.perf_counter()
        with torch.inference_mode(False), torch.no_grad():
            parameters = self.build(self.weight_seed)
        self._loaded = True
        logger.info(
            "engine loaded pipeline=%s stage=%s engine=%s parameters=%d load_s=%.2f",
            self.ctx.pipeline.name,
            self.ctx.stage.name,
            type(self).__name__,
            parameters,
            time.perf_counter() - started,
        )

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        """Every request's whole result (no streaming), in the batch's order."""
        results = []
        for stream in self._streams(batch, streaming=False):
            result = next(stream)
            if result is None:  # a whole run (no run_chunks) yields its one result
                raise RuntimeError(f"{self.where}: a whole run gave no result")
            results.append(result)
        return results

    def open(self, batch: Sequence[EngineRequest]) -> list[Iterator[EngineResult | None]]:
        return self._streams(batch, streaming=self.ctx.async_chunk)

    def _streams(
        self, batch: Sequence[EngineRequest], *, streaming: bool
    ) -> list[Iterator[EngineResult | None]]:
        if not self._loaded:
            raise RuntimeError(f"{self.where}: execute() called before load()")
        streams: list[Iterator[EngineResult | None]] = []
        for request in batch:  # validate everything first; a bad one fails alone, no compute
            try:
                inputs = self.parse(request)
            except EngineInputError as exc:
                logger.info(
                    "bad input stage=%s request_id=%s: %s",
                    self.ctx.stage.name,
                    request.request_id,
                    exc,
                )
                streams.append(iter([EngineResult(request.request_id, error=str(exc))]))
                continue
            streams.append(self._stream(request, inputs, streaming=streaming))
        return streams

    def _stream(
        self, request: EngineRequest, inputs: InputT, *, streaming: bool
    ) -> Iterator[EngineResult | None]:
        """The stream of one valid request (lazy: nothing runs before its first ``next()``)."""
        generator = make_generator(derive_seed("omni-mesh-request", self.where, request.seed))
        if streaming and request.whole:
            chunks = self.run_chunks(request, inputs, generator)
        else:
            chunks = self._run_whole(request, inputs, generator)
        return _in_inference_mode(chunks)

    def _run_whole(
        self, request: EngineRequest, inputs: InputT, generator: torch.Generator
    ) -> Iterator[EngineResult]:
        started = time.perf_counter()
        result = self.run(request, inputs, generator)
        logger.debug(
            "executed stage=%s request_id=%s ms=%.1f output_bytes=%d",
            self.ctx.stage.name,
            request.request_id,
            (time.perf_counter() - started) * 1e3,
            result.output.nbytes(),
        )
        yield result

    def run_chunks(
        self, request: EngineRequest, inputs: InputT, generator: torch.Generator
    ) -> Iterator[EngineResult | None]:
        """Execute one request as a stream of chunks (``last=True`` on the final one), one
        per ``next()``, each under ``torch.inference_mode()``; a None is a step with no chunk
        (the engine's other streams, and aborts, get their turn). The default: one
        :meth:`run`."""
        yield self.run(request, inputs, generator)

    def close(self) -> None:
        """Drop the model; ``execute`` fails until ``load`` runs again."""
        self._loaded = False
        vars(self).pop("model", None)

    def reader(self, request: EngineRequest) -> FieldReader:
        return FieldReader(f"{self.where} request {request.request_id!r}", request.data)

    @abstractmethod
    def build(self, seed: int) -> int:
        """Create the model with weights from ``seed``; return its parameter count."""

    @abstractmethod
    def parse(self, request: EngineRequest) -> InputT:
        """Validate one request's input (raise :class:`EngineInputError`); no model compute."""

    @abstractmethod
    def run(
        self, request: EngineRequest, inputs: InputT, generator: torch.Generator
    ) -> EngineResult:
        """Execute one request (inside ``torch.inference_mode()``)."""


_END = object()


def _in_inference_mode(
    chunks: Iterator[EngineResult | None],
) -> Iterator[EngineResult | None]:
    """``chunks`` advanced one ``next()`` at a time inside ``torch.inference_mode()``; the mode
    is left between items, so nothing else in the process runs in it. A None (no result this
    step) is passed on."""
    try:
        while True:
            with torch.inference_mode():
                item = next(chunks, _END)
            if item is _END:
                return
            yield cast("EngineResult | None", item)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
