"""The vLLM thinker split into prefill and decode replicas (deploy ``prefill:``; issue 33).

vLLM's ``NixlConnector`` moves the prompt's KV cache engine to engine, as for every split vLLM
stage (``engines/vllm/kv_split.py``). The talker also needs the prompt's rows (the input
embeddings and the accept layer's hidden states of every prompt position), and the decode
replica never computes them: vLLM loads the prompt's KV there and recomputes only the last
prompt position. So the rows move beside the KV:

- the prefill replica holds its tapped rows of the prompt (float32 [2, P, D]) in its own NIXL
  exchange (``kv/exchange.py``, as the transformers split thinker holds its prompt state) and
  adds where they are to the params vLLM's connector made, under :data:`ROWS_KEY`; the params
  travel through the sidecars as every split stage's do;
- the decode replica hands vLLM its own params and reads the rows at the same time (both pulls
  run while the request waits for its KV); the request's results wait until the rows are in.
  The rows it computes itself (from the recomputed last prompt position on) are its own.
- A rows read that fails, or params without usable rows, make the decode replica run the
  request again prefilled here (as a failed KV pull does, counted failed), so the answer is
  the one a pull would have given.

Cost: ``2 * D * 4`` bytes a prompt token beside vLLM's KV (``2 * layers * kv_heads * head_dim *
dtype size`` a token): for Qwen3-Omni-30B-A3B's thinker (D 2048; 48 layers, 4 KV heads of 128,
bf16) 16 KiB against 96 KiB, +17%.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from omni_mesh.data_plane.kv_transfer import KvTransferError
from omni_mesh.engines.base import EngineContext
from omni_mesh.engines.kv.exchange import KvExchange
from omni_mesh.engines.kv.pull import KvPull
from omni_mesh.engines.kv.stage_exchange import stage_exchange

logger = logging.getLogger(__name__)

#: Where the prompt rows' hold is named inside the params a prefill answers with.
ROWS_KEY = "omni_rows"
#: The tensor's name in the hold.
ROWS = "rows"


class PromptRows:
    """One split thinker engine's exchange for the prompt rows (module docstring)."""

    def __init__(self, ctx: EngineContext, hidden: int) -> None:
        self.hidden = hidden
        self.exchange: KvExchange = stage_exchange(ctx, 2 * hidden * 4, "prompt rows")

    def hold(self, kv_transfer: str, rows: np.ndarray) -> str:
        """The prefill's answer: vLLM's params ``kv_transfer`` with the hold of ``rows``
        (float32 [2, P, D]) added. Raises :class:`KvTransferError` (no room; no params)."""
        try:
            params = json.loads(kv_transfer)
        except ValueError:
            raise KvTransferError("vLLM gave the prefill no KV transfer params") from None
        held = self.exchange.hold({ROWS: torch.from_numpy(np.ascontiguousarray(rows))})
        params[ROWS_KEY] = json.loads(held)
        return json.dumps(params, separators=(",", ":"))

    def pull(self, kv_transfer: str, request_id: str) -> tuple[str, KvPull | None]:
        """A decode's params split: vLLM's part and the rows' read, started. ``("", None)``
        when the rows cannot be read: the decode prefills here (logged; counted by the
        exchange, or here for params that are not a prefill's)."""
        try:
            params = json.loads(kv_transfer)
            rows = params.pop(ROWS_KEY)
        except (ValueError, TypeError, KeyError, AttributeError):
            self.exchange.counts.failed += 1
            logger.warning("request_id=%s prefills here: no prompt rows in its params", request_id)
            return "", None
        try:
            pull = self.exchange.pull(json.dumps(rows))
        except KvTransferError as exc:
            logger.warning("request_id=%s prefills here: %s", request_id, exc)
            return "", None
        return json.dumps(params, separators=(",", ":")), pull

    def arrived(self, pull: KvPull) -> np.ndarray | None:
        """The rows once ``pull`` is done (None while it runs); raises
        :class:`KvTransferError` when it failed or gave rows of another width."""
        tensors = pull.poll()
        if tensors is None:
            return None
        rows = tensors.get(ROWS)
        ok = (
            rows is not None
            and rows.dtype == torch.float32
            and rows.dim() == 3
            and rows.shape[0] == 2
            and rows.shape[2] == self.hidden
        )
        pull.arrived(ok)
        if not ok or rows is None:
            shape = None if rows is None else (rows.dtype, tuple(rows.shape))
            raise KvTransferError(f"prompt rows {shape}, not float32 [2, P, {self.hidden}]")
        return rows.numpy()

    @property
    def held(self) -> int:
        return self.exchange.held

    def tick(self) -> None:
        self.exchange.tick()

    def close(self) -> None:
        self.exchange.close()
