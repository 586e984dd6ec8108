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

Knobs (``engine_extras``): ``kv_lease_s`` (30) how long a prefill's state waits for its pull;
``kv_buffer_mib`` (256) the hold and the receive buffers' size each (a prompt takes
``token_bytes`` a token: logged at start); ``kv_pull_timeout_s`` (10)
how long a read may take before the decode replica prefills instead;
``nixl_progress_delay_us`` (1000 on CPU, else 0) the NIXL progress thread's pause.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from omni_mesh.data_plane.kv_transfer import KvTransferError
from omni_mesh.engines.base import EngineConfigError, EngineContext, EngineRequest, EngineResult
from omni_mesh.engines.batching.frame_batch import FrameBatch, Row
from omni_mesh.engines.extras import extra_float, extra_int
from omni_mesh.engines.kv.exchange import KvExchange
from omni_mesh.engines.kv.nixl_agents import CPU_PROGRESS_DELAY_US

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_MIB = 256


class KvSplit:
    """One engine's part in a split stage (module docstring)."""

    def __init__(self, ctx: EngineContext, batch: FrameBatch[Any], token_bytes: int) -> None:
        self.batch = batch
        default_delay = CPU_PROGRESS_DELAY_US if ctx.device == "cpu" else 0
        name = f"{ctx.pipeline.name}-{ctx.stage.stage_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        buffer_bytes = extra_int(ctx, "kv_buffer_mib", DEFAULT_BUFFER_MIB, 1, 1 << 20) << 20
        logger.info(
            "split stage %d: KV buffers of %d MiB each, ~%d prompt tokens held (and as many "
            "pulled) at %d bytes a token (engine_extras.kv_buffer_mib)",
            ctx.stage.stage_id,
            buffer_bytes >> 20,
            buffer_bytes // max(1, token_bytes),
            token_bytes,
        )
        try:
            import nixl._api  # noqa: F401
        except ImportError as exc:
            raise EngineConfigError(
                f"stage {ctx.stage.stage_id} ({ctx.stage.name}): prefill: moves the prompt's "
                f"state over NIXL, which this environment lacks ({exc}; the vllm extra "
                "installs it)"
            ) from None
        self.exchange = KvExchange(
            name,
            buffer_bytes=buffer_bytes,
            lease_s=extra_int(ctx, "kv_lease_s", 30, 1, 3600),
            pull_timeout_s=extra_float(ctx, "kv_pull_timeout_s", 10.0, 0.1, 3600.0),
            progress_delay_us=extra_int(ctx, "nixl_progress_delay_us", default_delay, 0, 1_000_000),
        )
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
