"""A split stage on transformers (deploy ``prefill:``; the qwen3-omni thinker): the engine side
of the fabric's KV hand-off (``data_plane/kv_transfer.py``), as the vLLM engine has it on
vLLM's connector.

A prefill request (``PREFILL_REQUEST``) runs the row's prefill alone, when its stream is first
advanced, and answers with the params of its held state (``kv/exchange.py``) and nothing else.
A decode request (a prefill answer's params) gets a row whose prefill is pulled
(``row.remote``): the batch polls the read each step and the row joins once its state arrived;
params it cannot use, or a read that fails, make the row prefill here (counted ``failed``), so
the answer is the one a pull would have given. Every replica of a split stage can play both
parts (a decode replica also prefills for itself).

Knobs (``engine_extras``): see ``kv/stage_exchange.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from omni_mesh.data_plane.kv_transfer import KvTransferError
from omni_mesh.engines.base import EngineContext, EngineRequest, EngineResult
from omni_mesh.engines.batching.frame_batch import FrameBatch, Row
from omni_mesh.engines.kv.stage_exchange import stage_exchange

logger = logging.getLogger(__name__)


class KvSplit:
    """One engine's part in a split stage (module docstring)."""

    def __init__(self, ctx: EngineContext, batch: FrameBatch[Any], token_bytes: int) -> None:
        self.batch = batch
        self.exchange = stage_exchange(ctx, token_bytes)
        self._rate_at, self._rate_frames = time.monotonic(), 0

    def frame_rate(self, frames: int) -> float:
        """Frames per second since the last call, from the batch's total ``frames``."""
        now = time.monotonic()
        rate = (frames - self._rate_frames) / max(1e-6, now - self._rate_at)
        self._rate_at, self._rate_frames = now, frames
        return rate

    def prefill(self, request: EngineRequest, row: Row) -> Iterator[EngineResult | None]:
        """The prefill request's stream: its row prefilled alone at the first ``next()``,
        held, answered with the params."""
        return _PrefillStream(self, request, row)

    def pull(self, request: EngineRequest, row: Row) -> None:
        """A decode request's row gets its prefill from the params' prefill engine; unusable
        params leave it to prefill here (counted failed)."""
        try:
            row.remote = self.exchange.pull(request.kv_transfer)
        except KvTransferError as exc:
            logger.warning("request_id=%s prefills here: %s", request.request_id, exc)

    def tick(self) -> None:
        self.exchange.tick()

    def close(self) -> None:
        self.exchange.close()


class _PrefillStream:
    """One prefill request's stream (:meth:`KvSplit.prefill`): one result, the params."""

    def __init__(self, split: KvSplit, request: EngineRequest, row: Row) -> None:
        self.split = split
        self.request = request
        self.row: Row | None = row

    def __iter__(self) -> _PrefillStream:
        return self

    def __next__(self) -> EngineResult:
        row = self.row
        if row is None:
            raise StopIteration
        self.row = None
        batch, exchange = self.split.batch, self.split.exchange
        with torch.inference_mode():
            row_cache = batch.prefill(row)
            params = exchange.hold(batch.held(row, row_cache))
        return EngineResult(self.request.request_id, kv_transfer=params)

    def close(self) -> None:
        self.row = None
