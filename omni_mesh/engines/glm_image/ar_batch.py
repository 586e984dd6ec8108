"""GLM-Image's AR decoded for many requests at once: one batched forward per token, for every
running request, whatever its size.

It is ``generate`` as ``GlmImagePipeline.generate_prior_tokens`` calls it, unrolled step by step
(``batching/frame_batch.py`` holds the rows, ``batching/padded_cache.py`` their left-padded KV
cache):

* prefill (each request alone: its chat-templated prompt at positions 0…L-1 on the three rope
  axes) gives the row's first token;
* each step: every row's newest token at its own next decode position (``positions.py``: the
  grids of its own size, after its own prompt), in one forward over the rows' cache; each row's
  token from the last logits through ``generate``'s processors (``row_sampling``), drawn with the
  row's own generator;
* a row ends when it holds every grid's tokens and one more (the pipeline's ``max_new_tokens``)
  or on the end-of-image token; the forward of its last token never runs (as generate stops).

The model's own per-call position state (``rope_deltas``, ``_cached_decode_position_ids``, kept
for one batch of equal sizes) is never read: positions are passed per row, so requests of any
size share a step. A batch of one is the lone ``generate``'s computation, bit for bit (no padding
mask); in a larger batch the kernels may move logits in their last float bits, and the tests hold
each row's tokens equal to its lone run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_mesh.engines.batching.frame_batch import FrameBatch, Row
from omni_mesh.engines.batching.padded_cache import PaddedCache
from omni_mesh.engines.batching.row_sampling import RowPicker
from omni_mesh.engines.glm_image.positions import decode_positions, prompt_positions


@dataclass(frozen=True)
class ArPrompt:
    """The processor's output for one request: its token ids and its grids."""

    input_ids: Tensor  # [1, L]
    attention_mask: Tensor  # [1, L]
    grids: list[tuple[int, int]]  # (h, w) of the target grid, then the preview grid


@dataclass(eq=False)
class PriorRow(Row):
    """A request in the AR's batch; ``frames`` holds its tokens, one int64 [1] each."""

    prompt: ArPrompt | None = None
    positions: Tensor | None = None  # [3, N]: the decode positions of its N tokens
    tokens: list[int] = field(default_factory=list)  # generated so far, the newest last
    history: list[int] = field(default_factory=list)  # prompt + tokens (repetition penalty)

    @property
    def total(self) -> int:
        """Tokens the row decodes at most: its grids' and one more."""
        assert self.positions is not None
        return int(self.positions.shape[1])


class PriorBatch(FrameBatch[PriorRow]):
    """The AR's running requests (module docstring)."""

    prefill_frames = True

    def __init__(self, model: Any, picker: RowPicker, eos: int) -> None:
        super().__init__()
        self.model = model
        self.device = model.device
        self.picker = picker
        self.eos = eos
        # generate's repetition penalty reads the whole sequence; without one, no history
        self.penalised = picker.sampling.repetition_penalty != 1.0

    def prefill(self, row: PriorRow) -> Any:
        from transformers import DynamicCache

        prompt = row.prompt
        assert prompt is not None
        length = int(prompt.input_ids.shape[-1])
        row.positions = decode_positions(length, prompt.grids, self.device)
        if self.penalised:
            row.history = prompt.input_ids[0].tolist()
        cache = DynamicCache(config=self.model.config.text_config)
        out = self.model(
            input_ids=prompt.input_ids,
            attention_mask=prompt.attention_mask,
            position_ids=prompt_positions(length, self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        (token,) = self.picker.pick(out.logits[:, -1], [row.history], [row.generator])
        self._commit(row, token)
        return cache

    def decode(self, rows: list[PriorRow], cache: PaddedCache) -> None:
        input_ids = torch.tensor([[row.tokens[-1]] for row in rows], device=self.device)
        positions = torch.stack([self._fed_position(row) for row in rows], dim=1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=cache.step_mask(),
            position_ids=positions[..., None],  # [3, B, 1]
            past_key_values=cache.cache,
            use_cache=True,
        )
        tokens = self.picker.pick(
            out.logits[:, -1], [row.history for row in rows], [row.generator for row in rows]
        )
        cache.advanced()
        for row, token in zip(rows, tokens, strict=True):  # nothing failed: commit every row
            self._commit(row, token)

    @staticmethod
    def _fed_position(row: PriorRow) -> Tensor:
        """[3]: the decode position of the row's newest token, the one this step feeds."""
        assert row.positions is not None
        return row.positions[:, len(row.tokens) - 1]

    def _commit(self, row: PriorRow, token: int) -> None:
        row.tokens.append(token)
        if self.penalised:
            row.history.append(token)
        row.frames.append(np.array([token], dtype=np.int64))
        row.done = token == self.eos or len(row.tokens) >= row.total
