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

A row whose next frame needs input that has not come yet (a talker ahead of the streamed
thinker text it reads: :meth:`Row.ready`) is *parked*: its cache leaves the batch and the
others decode on; it rejoins (left-padded, as any row joins) at the first step it is ready
again, so its frames are those it would have made without the wait.

A split stage's decode replica gets a row's prefill from elsewhere (``row.remote``: a pull of
what a prefill replica held, ``kv/exchange.py``): the row waits, polled once per step, until
its state arrives (:meth:`FrameBatch.restore` turns it into the row's cache and fields); it
then joins where a row prefilled here would. A pull that fails makes the row prefill here, in
the same step. A prefill replica runs :meth:`FrameBatch.prefill` alone and hands
:meth:`FrameBatch.held` of the row to the exchange.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from omni_mesh.engines.batching.padded_cache import PaddedCache

logger = logging.getLogger(__name__)


class RemotePrefill(Protocol):
    """Where a row's prefill comes from when it does not run here (module docstring)."""

    def poll(self) -> dict[str, torch.Tensor] | None:
        """The row's prefilled state once it arrived, None while not; raises when it never
        will (the row then prefills here)."""

    def cancel(self) -> None:
        """Stop waiting (the row was removed)."""

    def arrived(self, ok: bool) -> None:
        """The state :meth:`poll` gave was taken (``ok``), or refused by
        :meth:`FrameBatch.restore`."""


@dataclass(eq=False)
class Row:
    """One request in a batched decode: what it produced so far and how it stands."""

    request_id: str
    generator: torch.Generator
    frames: list[np.ndarray] = field(default_factory=list)  # int64 [G] each
    done: bool = False  # no more frames will come
    error: BaseException | None = None  # why the row failed (then done too)
    remote: RemotePrefill | None = None  # its prefill comes from elsewhere (module docstring)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done = True

    def ready(self) -> bool:
        """Whether its next frame can be made now (module docstring: parked rows)."""
        return True


RowT = TypeVar("RowT", bound=Row)


class FrameBatch(ABC, Generic[RowT]):
    """The running rows of one engine and their batched decode (module docstring)."""

    #: True when :meth:`prefill` makes the row's first frame (module docstring).
    prefill_frames = False

    def __init__(self) -> None:
        self.cache = PaddedCache()
        self.running: list[RowT] = []  # in the cache's row order
        self.pending: list[RowT] = []  # joined since the last step, not prefilled yet
        self.waiting: list[RowT] = []  # their prefill comes from elsewhere (``row.remote``)
        self.parked: list[tuple[RowT, Any]] = []  # not ready (module docstring), own caches
        self.frames_made = 0  # by the batched decodes, since the start

    def add(self, row: RowT) -> None:
        """Queue a row; its prefill runs at the next :meth:`step` (or arrives: ``row.remote``)."""
        (self.pending if row.remote is None else self.waiting).append(row)

    def remove(self, row: RowT) -> None:
        """Take a row out (an aborted request); a no-op for a row that already left."""
        if row in self.pending:
            self.pending.remove(row)
        elif row in self.waiting:
            self.waiting.remove(row)
            if row.remote is not None:
                row.remote.cancel()
        elif row in self.running:
            index = self.running.index(row)
            self.running.pop(index)
            self.cache.drop(index)
        else:
            self.parked = [(r, c) for r, c in self.parked if r is not row]

    @property
    def busy(self) -> bool:
        return bool(self.running or self.pending or self.waiting or self.parked)

    @property
    def starved(self) -> bool:
        """Every row is parked, and none is ready yet: a step would do nothing."""
        return (
            bool(self.parked)
            and not (self.running or self.pending or self.waiting)
            and not any(_ready(row) for row, _ in self.parked)
        )

    def is_parked(self, row: RowT) -> bool:
        return any(r is row for r, _ in self.parked)

    def step(self) -> None:
        """Every new row prefilled (or its prefill arrived), then one frame for every running
        row (with :attr:`prefill_frames`, the running rows' decode first: the new rows' frame
        is their prefill's)."""
        arrived = self._arrivals()
        pending, self.pending = self.pending, []
        first, after = ([], pending) if self.prefill_frames else (pending, [])
        early, late = ([], arrived) if self.prefill_frames else (arrived, [])
        for row in first:
            self._prefill(row)
        for row, row_cache in early:
            self._join(row, row_cache)
        self._unpark()
        self._park_unready()
        if self.running:
            self._decode_all()
            self.frames_made += len(self.running)
        for row in after:
            self._prefill(row)
        for row, row_cache in late:
            self._join(row, row_cache)
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

    def held(self, row: RowT, row_cache: Any) -> dict[str, torch.Tensor]:
        """What a decode replica needs to go on with ``row`` after its :meth:`prefill` here
        (the cache's layers, the row's state): tensors, for ``kv/exchange.py``. Only a model
        whose stage can be split has it."""
        raise NotImplementedError(f"{type(self).__name__} cannot hand its prefill on")

    def restore(self, row: RowT, state: dict[str, torch.Tensor]) -> Any:
        """The row as :meth:`held` saw it, from its tensors: its cache (or None when the row
        ended there), its fields set as its own prefill would have. A state that does not fit
        the row and the model raises before the row changes (the row then prefills here)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take a prefill from elsewhere")

    def _arrivals(self) -> list[tuple[RowT, Any]]:
        """The waiting rows whose state arrived, each with its cache; a row whose pull failed
        goes to ``pending``, to prefill here."""
        arrived = []
        for row in list(self.waiting):
            assert row.remote is not None
            remote = row.remote
            try:
                state = remote.poll()
                if state is None:
                    continue
            except Exception as exc:
                logger.warning("prefill of request_id=%s runs here: %s", row.request_id, exc)
                self.pending.append(row)
            else:
                try:
                    arrived.append((row, self.restore(row, state)))
                    remote.arrived(True)
                except Exception as exc:
                    remote.arrived(False)
                    logger.warning("prefill of request_id=%s runs here: %s", row.request_id, exc)
                    self.pending.append(row)
            self.waiting.remove(row)
            row.remote = None
        return arrived

    def _prefill(self, row: RowT) -> None:
        try:
            row_cache = self.prefill(row)
        except Exception as exc:
            logger.exception("prefill failed request_id=%s", row.request_id)
            row.fail(exc)
            return
        self._join(row, row_cache)

    def _join(self, row: RowT, row_cache: Any) -> None:
        if row_cache is not None and not row.done:
            try:
                self.cache.join(row_cache)
            except Exception as exc:  # a cache of another shape (a prefill from elsewhere)
                logger.exception("request_id=%s cannot join the batch", row.request_id)
                row.fail(exc)
                return
            self.running.append(row)

    def _unpark(self) -> None:
        """The parked rows that are ready rejoin the batch."""
        if not self.parked:
            return
        parked, self.parked = self.parked, []
        for row, row_cache in parked:
            if _ready(row):  # (a row that failed is joined, then leaves at the step's end)
                self._join(row, row_cache)
            else:
                self.parked.append((row, row_cache))

    def _park_unready(self) -> None:
        """The running rows that are not ready leave the batch, each with its cache."""
        for index in reversed(range(len(self.running))):
            row = self.running[index]
            if row.done:
                continue
            ready = _ready(row)
            if row.error is not None:  # its check failed: it leaves now
                self.running.pop(index)
                self.cache.drop(index)
            elif not ready:
                self.running.pop(index)
                self.parked.append((row, self.cache.take(index)))

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


def _ready(row: Row) -> bool:
    """``row.ready()``; a row whose check raises fails alone (and counts as ready: it leaves)."""
    try:
        return row.ready()
    except Exception as exc:
        logger.exception("request_id=%s: its input cannot be read", row.request_id)
        row.fail(exc)
        return True
