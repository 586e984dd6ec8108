"""The synthetic engine: a stage with a latency model and a sized output, for benchmarks.

Each ``execute`` call sleeps ``step_latency_ms + per_item_latency_ms * len(batch)`` milliseconds
once (simulating accelerator time without burning CPU) and gives every request an array ``data``
of ``output_bytes`` uint8 bytes, deterministic for the request's seed and stage (a seeded 4 KiB
block, tiled). Incoming fields pass through to ``output``; as a final stage
(``stage.final_output`` set) the same array is the final output, ``final.arrays["data"]``.

Under the engine core (``open``), the streams compute nothing slow: the core calls
``before_step(k)`` once per step, which sleeps ``a + b*k`` ms for the ``k`` streams it is about
to advance, so a step costs what the latency model says however many streams it carries. With
``ctx.async_chunk`` and a whole input, a request's output is ``output_chunks`` chunks, one per
step, of ``output_bytes // output_chunks`` bytes (the first ``output_bytes % output_chunks``
one byte more). The data of chunk ``c`` is :func:`chunk_bytes` of (seed, stage, c): chunk 0 of
a one-chunk output is the whole output of ``execute``, byte for byte. A chunk of an upstream
stream gets one output of ``output_bytes`` bytes keyed by the input's chunk index.

A join stage (several sources) reports what it received in its final output's fields:
``join_sources`` (the source names its input arrays carry, ``<source>.<name>``) and
``join_sha256`` (:func:`join_digest` of its input arrays). For tests, a request whose ``prompt``
field is ``fail:<stage name>`` fails at that stage (``bad_input``: the stage's error, as data).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData, StageEngine

logger = logging.getLogger(__name__)

BLOCK_BYTES = 4096


def synthetic_bytes(seed: int, salt: str, nbytes: int) -> np.ndarray:
    """``nbytes`` uint8 bytes: a block of up to 4 KiB derived from ``(seed, salt)``, tiled.

    The block is a SHAKE-256 stream of the key: one C call, a few µs, so a no-op stage costs
    next to nothing here (a numpy Generator took tens of µs to build per request)."""
    if nbytes <= 0:
        return np.empty(0, dtype=np.uint8)
    block = hashlib.shake_256(f"{salt}\x1f{seed}".encode()).digest(min(nbytes, BLOCK_BYTES))
    data = np.frombuffer(block, dtype=np.uint8)
    return data.copy() if nbytes <= BLOCK_BYTES else np.resize(data, nbytes)


def chunk_bytes(seed: int, salt: str, chunk: int, nbytes: int) -> np.ndarray:
    """The data of output chunk ``chunk``: :func:`synthetic_bytes` salted with the chunk index
    (chunk 0 keeps the stage's plain salt, so a whole output is unchanged)."""
    return synthetic_bytes(seed, salt if chunk == 0 else f"{salt}#{chunk}", nbytes)


def chunk_sizes(nbytes: int, chunks: int) -> list[int]:
    """``chunks`` sizes summing to ``nbytes``, the first ``nbytes % chunks`` one byte larger."""
    base, extra = divmod(nbytes, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


class SyntheticEngine(StageEngine):
    """Sleeps per the latency model ``a + b*batch`` ms; outputs ``output_bytes`` bytes."""

    uses_torch: ClassVar[bool] = False  # numpy only: its process never imports torch

    def load(self) -> None:
        config = self.ctx.config
        self.salt = f"{self.ctx.pipeline.name}/{self.ctx.stage.stage_id}"
        logger.info(
            "synthetic engine ready pipeline=%s stage=%s step_latency_ms=%.3f "
            "per_item_latency_ms=%.3f output_bytes=%d",
            self.ctx.pipeline.name,
            self.ctx.stage.name,
            config.step_latency_ms,
            config.per_item_latency_ms,
            config.output_bytes,
        )

    def step_seconds(self, batch_size: int) -> float:
        config = self.ctx.config
        return (config.step_latency_ms + config.per_item_latency_ms * batch_size) / 1e3

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        if not batch:
            return []
        started = time.perf_counter()
        results = [self._result(request) for request in batch]
        # Sleep what is left of the modelled step time (output generation counts towards it).
        remaining = self.step_seconds(len(batch)) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return results

    def open(self, batch: Sequence[EngineRequest]) -> list[Iterator[EngineResult]]:
        return [self._stream(request) for request in batch]

    def before_step(self, streams: int) -> None:
        """The modelled cost of a step that advances ``streams`` streams, slept once."""
        seconds = self.step_seconds(streams)
        if seconds > 0:
            time.sleep(seconds)

    def _stream(self, request: EngineRequest) -> Iterator[EngineResult]:
        config = self.ctx.config
        if not (self.ctx.async_chunk and request.whole) or config.output_chunks == 1:
            yield self._result(request, request.chunk, config.output_bytes)
            return
        sizes = chunk_sizes(config.output_bytes, config.output_chunks)
        for chunk, nbytes in enumerate(sizes):
            yield self._result(request, chunk, nbytes, last=chunk == len(sizes) - 1)

    def _result(
        self, request: EngineRequest, chunk: int = 0, nbytes: int | None = None, last: bool = True
    ) -> EngineResult:
        stage = self.ctx.stage
        if request.data.fields.get("prompt") == f"fail:{stage.name}":
            error = f"synthetic failure requested at stage {stage.stage_id} ({stage.name})"
            return EngineResult(request.request_id, error=error)
        size = self.ctx.config.output_bytes if nbytes is None else nbytes
        data = chunk_bytes(request.seed, self.salt, chunk, size)
        output = StageData(fields=dict(request.data.fields), arrays={"data": data})
        final = StageData(arrays={"data": data}) if stage.final_output else None
        if final is not None and len(stage.sources) > 1:
            sources = sorted({name.partition(".")[0] for name in request.data.arrays})
            final.fields = {
                "join_sources": ",".join(sources),
                "join_sha256": join_digest(request.data.arrays),
            }
        return EngineResult(request.request_id, output=output, final=final, last=last)


def join_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over ``name`` + NUL + the bytes of every array, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode() + b"\0" + np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()
