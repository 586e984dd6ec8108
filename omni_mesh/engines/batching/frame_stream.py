"""One request's stream of results out of a :class:`FrameBatch` (the engine protocol's stream).

Each ``next()`` takes the row's next frame: one the batch already made (the engine's
``before_step`` runs :meth:`FrameBatch.step` once per core step, for every row at once), or, when
there is none yet, a :meth:`FrameBatch.step` run right there (a caller that drives streams
without ``before_step``). It yields ``None`` until a chunk is full: the first after
``first_chunk_frames`` frames, then every ``chunk_frames``, and the last one (``last=True``) when
the row ends, so an abort waits for one frame, not a chunk; a chunk with nothing to send yet
(the chunker's None) leaves its frames for the next. Not streaming, it yields ``None``
until the row ends, then one whole result. ``close()`` (the core's abort) takes the row out of the
batch. A row that failed raises its exception from ``next()``: the core fails that request alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omni_mesh.engines.base import EngineResult
from omni_mesh.engines.batching.frame_batch import FrameBatch, Row

#: Builds a result from (frames so far, frames sent before, last?): ``codes.codes_chunk``'s shape;
#: None when a chunk has nothing to send yet (never for the last one): the frames wait for the next.
Chunker = Callable[[list[np.ndarray], int, bool], EngineResult | None]


class FrameStream:
    """Iterator of one row's results (module docstring)."""

    def __init__(
        self,
        batch: FrameBatch[Any],
        row: Row,
        chunk: Chunker,
        *,
        streaming: bool,
        first_chunk_frames: int,
        chunk_frames: int,
    ) -> None:
        self.batch = batch
        self.row = row
        self._chunk = chunk
        self._streaming = streaming
        self._first = first_chunk_frames
        self._every = chunk_frames
        self._seen = 0  # frames taken by next() so far
        self._sent = 0  # frames handed out in results
        self._closed = False
        batch.add(row)

    def __iter__(self) -> FrameStream:
        return self

    def __next__(self) -> EngineResult | None:
        if self._closed:
            raise StopIteration
        row = self.row
        if (
            self._seen == len(row.frames)
            and not row.done
            and row.remote is None
            and (not self.batch.is_parked(row) or row.ready())
        ):  # (a row waiting for its state or its input: before_step polls it)
            with torch.inference_mode():
                self.batch.step()
        if row.error is not None:
            self.close()
            raise row.error
        if self._seen < len(row.frames):
            self._seen += 1
        last = row.done and self._seen == len(row.frames)
        goal = self._sent + (self._every if self._sent else self._first)
        if not last and (not self._streaming or self._seen < goal):
            return None
        result = self._chunk(row.frames[: self._seen], self._sent, last)
        if result is None:
            if last:
                self.close()
                raise RuntimeError(f"no last result for request_id={row.request_id}")
            return None
        self._sent = self._seen
        if last:
            self.close()
        return result

    def close(self) -> None:
        """Leave the batch (an abort, or the end of the stream)."""
        if not self._closed:
            self._closed = True
            self.batch.remove(self.row)
