"""CSM's talker decoded for many requests at once: one batched run of the depth decoder and one
batched forward of the Llama backbone per frame, for every running request.

It is ``CsmForConditionalGeneration.generate`` (transformers 5, ``generation_csm``) unrolled,
step for step, as a user of the monolithic model calls it:

* prefill (each request alone): the chat-templated text's embeddings (``embed_text_tokens``) at
  positions ``0..L-1``; the head's logits at the last position give codebook 0 of the first
  frame;
* each frame: the depth decoder starts from a fresh cache on ``[0, codebook 0]`` with the
  backbone's last hidden state in place of the 0, and samples the other ``num_codebooks - 1``
  codebooks with its own settings (``depth_decoder_*``); the frame goes out unless it is the
  end frame (every codebook ``codebook_eos_token_id``, which the monolithic decode cuts), and
  the row ends when the frame's codebooks but the last are all EOS (CSM's stopping rule) or
  after its ``max_new_tokens`` frames;
* the backbone's next input is the frame (its codebook embeddings summed) at position + 1, and
  its head gives codebook 0 of the next frame.

Every row samples from its own generator in the monolith's order (codebook 0, then the depth
decoder's draws), and rows of different lengths share one left-padded cache with their own
positions (``padded_cache``), so a request's codes are those it gets alone; a batch of one runs
the lone ``generate``'s exact computation. A row that ends still takes part in the round's
backbone forward (its draw there is never used), which keeps the batch in one piece. Batched
kernels may move the logits in their last float bits; the codes rely on no choice being that
close (tiny-csm's heads are drawn wide for that: ``tiny``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_mesh.engines.batching.frame_batch import FrameBatch, Row
from omni_mesh.engines.batching.padded_cache import PaddedCache
from omni_mesh.engines.batching.row_sampling import RowPicker, Sampling


@dataclass(eq=False)
class CsmRow(Row):
    """A request in CSM's batch; the model state it carries between frames."""

    input_ids: np.ndarray | None = None  # [T] int64: the chat-templated prompt
    cap: int = 0  # frames this request may generate (its max_new_tokens)
    generated: int = 0  # frames generated so far (the one that ends the row included)
    first: int = 0  # codebook 0 of the next frame, sampled, not yet through the depth decoder
    hidden: Tensor | None = None  # [1, H]: the backbone's last hidden state at the newest entry
    position: Tensor | None = None  # [1, 1]: the newest entry's position


def ends_utterance(frame: np.ndarray, eos: int) -> bool:
    """CSM's generate stops after a frame whose codebooks but the last are all EOS."""
    return bool((frame[:-1] == eos).all())


def is_end_frame(frame: np.ndarray, eos: int) -> bool:
    """A frame of EOS in every codebook: not spoken (the monolithic decode cuts the codes at the
    first one)."""
    return bool((frame == eos).all())


class CsmBatch(FrameBatch[CsmRow]):
    """CSM's running requests (module docstring)."""

    def __init__(self, model: Any, backbone: Sampling, depth: Sampling) -> None:
        super().__init__()
        self.model = model
        self.device = model.device
        self.depth = model.depth_decoder
        self.groups = int(model.config.num_codebooks)
        self.eos = int(model.config.codebook_eos_token_id)
        self.picker = RowPicker(backbone)
        self.depth_picker = RowPicker(depth)

    def prefill(self, row: CsmRow) -> Any:
        from transformers import DynamicCache

        assert row.input_ids is not None
        ids = torch.from_numpy(np.array(row.input_ids))[None].to(self.device)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        cache = DynamicCache()
        first, hidden = self._backbone(
            self.model.embed_text_tokens(ids), positions, cache, None, [row.generator]
        )
        row.first = first[0]
        row.hidden = hidden
        row.position = positions[:, -1:]
        return cache

    def decode(self, rows: list[CsmRow], cache: PaddedCache) -> None:
        generators = [row.generator for row in rows]
        firsts = torch.tensor([[row.first] for row in rows], device=self.device)
        hidden = torch.cat([row.hidden for row in rows if row.hidden is not None])
        frames = torch.cat((firsts, self._depth_codes(firsts, hidden, generators)), dim=1)
        positions = torch.cat([row.position for row in rows if row.position is not None]) + 1
        embeds = self.model.backbone_model.embed_tokens(frames[:, None, :])
        nexts, hidden = self._backbone(
            embeds, positions, cache.cache, cache.step_mask(), generators
        )
        cache.advanced()
        codes = frames.cpu().numpy().astype(np.int64)
        for i, row in enumerate(rows):  # nothing failed: commit every row
            row.generated += 1
            if not is_end_frame(codes[i], self.eos):
                row.frames.append(codes[i])
            row.done = ends_utterance(codes[i], self.eos) or row.generated >= row.cap
            row.first = nexts[i]
            row.hidden = hidden[i : i + 1]
            row.position = positions[i : i + 1]

    def _backbone(
        self,
        embeds: Tensor,
        positions: Tensor,
        cache: Any,
        mask: Tensor | None,
        generators: list[torch.Generator],
    ) -> tuple[list[int], Tensor]:
        """One backbone forward: codebook 0 of every row's next frame, and the rows' last
        hidden states [B, H] (the depth decoder's first input)."""
        out = self.model.backbone_model(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        states = out.last_hidden_state
        logits = self.model.lm_head(states[:, -1:, :])[:, -1]
        return self.picker.pick(logits, [[]] * len(generators), generators), states[:, -1, :]

    def _depth_codes(
        self, firsts: Tensor, hidden: Tensor, generators: list[torch.Generator]
    ) -> Tensor:
        """Codebooks 1..G-1 of every row's frame: the depth decoder's own generate, batched
        (every row has the same length: it restarts from a fresh cache every frame)."""
        from transformers import DynamicCache

        rows = firsts.shape[0]
        cache = DynamicCache()
        out = self.depth(
            input_ids=torch.nn.functional.pad(firsts, (1, 0), value=0),
            backbone_last_hidden_state=hidden.clone(),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        codes = [self.depth_picker.pick(out.logits[:, -1], [[]] * rows, generators)]
        for _ in range(self.groups - 2):
            out = self.depth(
                input_ids=torch.tensor(codes[-1], device=self.device)[:, None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            codes.append(self.depth_picker.pick(out.logits[:, -1], [[]] * rows, generators))
        return torch.tensor(codes, device=self.device).T.contiguous()
