"""The engine side of a batched stage (the talkers, the qwen3-omni thinker): every request a row
of one :class:`FrameBatch`.

:class:`FrameEngine` is a :class:`TorchEngine` whose requests never run alone: ``open``
gives each request a :class:`FrameStream` over the engine's one batch (chunks under
``async_chunk`` for a whole input, else one whole result when the row ends), ``before_step``
advances the batch by one frame once per core step, and ``execute`` drives a batch of whole
results the same way until every request has its answer. A bad input is answered at once
(the :meth:`TorchEngine.parse` error), and so is a request the subclass answers without the
model (:meth:`FrameEngine.row` returning a result).

A split stage's engine (deploy ``prefill:``) sets :attr:`FrameEngine.kv` in its ``build``: its
prefill requests are answered with where their state waits, its decode requests' rows pull it
(``kv_split.py``); it then reports its scheduler's view and its transfers in :meth:`stats`.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from omni_mesh.data_plane.kv_transfer import is_prefill
from omni_mesh.data_plane.messages import EngineStats
from omni_mesh.engines.base import EngineRequest, EngineResult
from omni_mesh.engines.batching.frame_batch import FrameBatch, Row
from omni_mesh.engines.batching.frame_stream import Chunker, FrameStream
from omni_mesh.engines.batching.kv_split import KvSplit
from omni_mesh.engines.torch_engine import TorchEngine

logger = logging.getLogger(__name__)

#: The pause of a step that has only rows waiting for their pulled state (a read takes ~1 ms).
WAIT_POLL_S = 0.0005

InputT = TypeVar("InputT")


class FrameEngine(TorchEngine[InputT]):
    """Base of the batched engines (module docstring). A subclass's ``build`` sets ``batch``,
    ``first_chunk_frames`` and ``chunk_frames``."""

    batch: FrameBatch[Any]
    first_chunk_frames: int
    chunk_frames: int
    kv: KvSplit | None = None  # a split stage's (module docstring)

    @abstractmethod
    def row(self, request: EngineRequest, inputs: InputT) -> Row | EngineResult:
        """The request's row for the batch, or its whole answer when it needs no model."""

    def chunk(
        self, request: EngineRequest, frames: list[np.ndarray], sent: int, last: bool
    ) -> EngineResult:
        """The result carrying ``frames[sent:]`` (``last``: the request's final one); an engine
        overrides this, or :meth:`chunker` when its results need more than the frames."""
        raise NotImplementedError(f"{type(self).__name__} makes no chunks of frames alone")

    def chunker(self, request: EngineRequest, row: Row) -> Chunker:
        """What makes the results of ``request``'s stream over ``row``: :meth:`chunk`, by
        default."""
        return lambda frames, sent, last: self.chunk(request, frames, sent, last)

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        """Every request's whole result, all of them decoded together in one batch."""
        streams = self._streams(batch, streaming=False)
        results: list[EngineResult | None] = [None] * len(streams)
        while any(result is None for result in results):
            self.before_step(len(streams))
            for i, (request, stream) in enumerate(zip(batch, streams, strict=True)):
                if results[i] is None:
                    results[i] = _next_or_error(request, stream)
        return [result for result in results if result is not None]

    def before_step(self, streams: int) -> None:
        """One frame for every running request (the rows opened since the last step join)."""
        batch = self.batch
        if self.kv is not None:
            self.kv.tick()
            if batch.waiting and not (batch.running or batch.pending):
                time.sleep(WAIT_POLL_S)  # only reads in flight: poll them, not spin on them
        if batch.busy:
            with torch.inference_mode():
                batch.step()

    def idle(self) -> None:
        if self.kv is not None:
            self.kv.tick()  # frees what was pulled or expired

    def waits_for_input(self) -> bool:
        """Every row waits for more of its streamed input (``FrameBatch.starved``)."""
        return self.batch.starved

    def holds_work(self) -> bool:
        """A prefill replica's states not pulled yet (until their lease): a drain waits."""
        return self.kv is not None and self.kv.exchange.held > 0

    def stats(self) -> EngineStats | None:
        """A split stage's view (its rows, its frames per second, its transfers, the prompt
        tokens of prefills not run yet); None unsplit."""
        if self.kv is None:
            return None
        batch = self.batch
        return EngineStats(
            running=len(batch.running),
            waiting=len(batch.pending) + len(batch.waiting),
            kv_cache_usage=0.0,  # a DynamicCache grows as it needs: no fixed pool to fill
            tokens_per_s=self.kv.frame_rate(batch.frames_made),
            # A prefill request runs in the step it arrives in: none queued between steps.
            prefill_tokens_queued=0,
            **self.kv.exchange.counts.stats_fields(),
        )

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
        super().close()

    def run(
        self, request: EngineRequest, inputs: InputT, generator: torch.Generator
    ) -> EngineResult:
        """One request's whole result (in a batch of its own)."""
        stream = self._stream(request, inputs, streaming=False)
        result = next(stream)
        while result is None:
            self.before_step(1)
            result = next(stream)
        return result

    def _stream(
        self, request: EngineRequest, inputs: InputT, *, streaming: bool
    ) -> Iterator[EngineResult | None]:
        """The request's stream over the batch (its row joins at the next step)."""
        row = self.row(request, inputs)
        if isinstance(row, EngineResult):
            return iter([row])
        if self.kv is not None and request.kv_transfer:
            if is_prefill(request.kv_transfer):
                return self.kv.prefill(request, row)
            self.kv.pull(request, row)
        return FrameStream(
            self.batch,
            row,
            self.chunker(request, row),
            streaming=streaming and request.streams_out,
            first_chunk_frames=self.first_chunk_frames,
            chunk_frames=self.chunk_frames,
        )


def _next_or_error(
    request: EngineRequest, stream: Iterator[EngineResult | None]
) -> EngineResult | None:
    """The stream's next item; an exception or an early end as the request's error result."""
    try:
        return next(stream)
    except StopIteration:
        return EngineResult(request.request_id, error="engine returned no result")
    except Exception as exc:
        logger.exception("request failed request_id=%s", request.request_id)
        return EngineResult(request.request_id, error=f"{type(exc).__name__}: {exc}")
