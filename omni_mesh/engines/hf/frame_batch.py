"""Continuous batching of a stage's requests (an audio talker's, an LM's), one frame per step.

A :class:`FrameBatch` holds the running rows (one per request) and one left-padded KV cache over
them (``padded_cache.py``). :meth:`FrameBatch.step` advances every row by one frame: the rows
that joined since the last step prefill first, each alone (their prompts differ in length), and
join the batch; then one batched decode (the model's: :meth:`FrameBatch.decode`) gives every
row its next frame. A row leaves when it ends (its model's end token, or its frame cap) or when
its stream is closed (an abort), and the others run on undisturbed.

A model whose prompt already gives a row's first frame (an LM's first token) sets
:attr:`FrameBatch.prefill_frames`: its rows then prefill after the step's decode, so a step
gives every row exactly one frame there too.

Failures stay with their request: a prefill that raises fails its row alone; a batched decode
that raises is undone (the cache's layers and the rows' generators as they were; ``decode``
changes a row only after its forward passes) and run again row by row, each alone, so only
the rows that fail on their own fail.

Rows draw their samples from their own generators and the decode keeps each row's positions,
so a request's frames depend on its seed alone, never on its batchmates.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from omni_mesh.engines.hf.padded_cache import PaddedCache

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Row:
    """One request in a batched decode: what it produced so far and how it stands."""

    request_id: str
    generator: torch.Generator
    frames: list[np.ndarray] = field(default_factory=list)  # int64 [G] each
    done: bool = False  # no more frames will come
    error: BaseException | None = None  # why the row failed (then done too)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done = True


RowT = TypeVar("RowT", bound=Row)


class FrameBatch(ABC, Generic[RowT]):
    """The running rows of one engine and their batched decode (module docstring)."""

    #: True when :meth:`prefill` makes the row's first frame (module docstring).
    prefill_frames = False

    def __init__(self) -> None:
        self.cache = PaddedCache()
        self.running: list[RowT] = []  # in the cache's row order
        self.pending: list[RowT] = []  # joined since the last step, not prefilled yet

    def add(self, row: RowT) -> None:
        """Queue a row; its prefill runs at the next :meth:`step`."""
        self.pending.append(row)

    def remove(self, row: RowT) -> None:
        """Take a row out (an aborted request); a no-op for a row that already left."""
        if row in self.pending:
            self.pending.remove(row)
        elif row in self.running:
            index = self.running.index(row)
            self.running.pop(index)
            self.cache.drop(index)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.pending)

    def step(self) -> None:
        """Every waiting row prefilled, then one frame for every running row (with
        :attr:`prefill_frames`, the running rows' decode first: the new rows' frame is their
        prefill's)."""
        pending, self.pending = self.pending, []
        first, after = ([], pending) if self.prefill_frames else (pending, [])
        for row in first:
            self._prefill(row)
        if self.running:
            self._decode_all()
        for row in after:
            self._prefill(row)
        for index in reversed(range(len(self.running))):
            if self.running[index].done:
                self.running.pop(index)
                self.cache.drop(index)

    @abstractmethod
    def prefill(self, row: RowT) -> Any:
        """Run the row's prompt alone; its own (batch of one) KV cache, or None when the row
        ended there (``row.done``). Its first frame comes from the next :meth:`decode`, or from
        the prefill itself with :attr:`prefill_frames`."""

    @abstractmethod
    def decode(self, rows: list[RowT], cache: PaddedCache) -> None:
        """One frame for each of ``rows`` (the cache's rows, in order), appended to
        ``row.frames``, ``row.done`` set for a row that ended; ``cache.advanced()`` after the
        forward that grows it. Raise before changing any row when something fails."""

    def _prefill(self, row: RowT) -> None:
        try:
            row_cache = self.prefill(row)
            if row_cache is not None and not row.done:
                self.cache.join(row_cache)
                self.running.append(row)
        except Exception as exc:
            logger.exception("prefill failed request_id=%s", row.request_id)
            row.fail(exc)

    def _decode_all(self) -> None:
        rows = list(self.running)
        snapshot = self.cache.snapshot()
        states = [row.generator.get_state() for row in rows]
        try:
            self.decode(rows, self.cache)
            return
        except Exception:
            logger.exception("batched decode of %d rows failed; each row runs alone", len(rows))
        self.cache.restore(snapshot)
        for row, state in zip(rows, states, strict=True):
            row.generator.set_state(state)
        self._decode_alone(rows)

    def _decode_alone(self, rows: list[RowT]) -> None:
        """Each row decoded with its own cache; the ones that pass form the new batch."""
        batch = PaddedCache()
        survivors = []
        for row, row_cache in zip(rows, self.cache.split(), strict=True):
            alone = PaddedCache()
            alone.join(row_cache)
            try:
                self.decode([row], alone)
            except Exception as exc:
                logger.exception("decode failed request_id=%s", row.request_id)
                row.fail(exc)
                continue
            batch.join(alone.cache)
            survivors.append(row)
        self.cache = batch
        self.running = survivors
