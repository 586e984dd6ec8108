"""Qwen3-Omni's talker decoded for many requests at once: one batched forward of the MoE talker
and one batched run of its code predictor per frame, for every running request.

It is ``Qwen3OmniMoeTalkerForConditionalGeneration.generate`` (transformers 5) unrolled, step
for step, as the monolithic model calls it:

* prefill (each request alone): the prompt's embeddings at text positions ``0..L-1`` (with
  audio input, the 3-D multimodal RoPE of ``get_rope_index`` over ``talker_input_ids``); the
  codec head's last logits give codebook 0 of the first frame;
* each frame: the code predictor starts from a fresh cache on [the talker's last hidden state,
  the embedding of codebook 0] and samples the other ``num_code_groups - 1`` codebooks (its own
  settings: top-k 50, top-p 0.8, sampled when the talker samples, as ``prepare_inputs_for_
  generation`` calls it); the frame is emitted, and the talker's next input is the sum of the
  frame's codebook embeddings plus the next ``trailing_text_hidden`` entry (``tts_pad_embed``
  once the text is spoken), at each position id + 1;
* codebook 0 of the next frame comes from the talker's logits through ``generate``'s processors
  (``row_sampling``); a row ends on ``codec_eos`` or after ``max_frames`` tokens, the last
  token having no frame (as ``generate`` stops before the code predictor runs on it).

Rows of different lengths share one left-padded KV cache (``padded_cache``) with their own
position ids, and every row samples with its own generator, so a request's codes are those it
gets alone. A batch of one runs the lone ``generate``'s exact computation (no mask:
``PaddedCache.step_mask``). In a larger batch the kernels (the padding mask, a matmul over B
rows instead of one) may move the logits in their last float bits, and the codes rely on no
choice being that close: measured on tiny-qwen3-omni (8 rows against each alone), the talker's
logits moved by at most 3.1e-5 and the code predictor's by 3.8e-5, while the closest top-two
logits were 3.6e-3 and 1.7e-2 apart (its heads are drawn with std 2.0 for that: see
``tiny``); a sampled draw flips only if its uniform number falls within such a
difference of a boundary between two codes. The equality tests hold the codes equal to the
monolithic ``generate``'s, alone and batched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_mesh.engines.batching.frame_batch import FrameBatch, Row
from omni_mesh.engines.batching.padded_cache import PaddedCache
from omni_mesh.engines.batching.row_sampling import RowPicker, Sampling
from omni_mesh.engines.qwen3_omni.talker_prompt import TalkerPrompt
from omni_mesh.engines.qwen3_omni.talker_text import StreamedText

#: The code predictor's own sampling inside the talker's generate (``prepare_inputs_for_
#: generation``): top-k 50 and top-p 0.8 whenever the talker samples.
PREDICTOR_TOP_K = 50
PREDICTOR_TOP_P = 0.8


@dataclass(eq=False)
class TalkerRow(Row):
    """A request in the talker's batch; the model state it carries between frames."""

    build: Callable[[], TalkerPrompt] | None = None  # the prompt, built at prefill
    prompt: TalkerPrompt | None = None
    tokens: list[int] | None = None  # codebook 0 of every frame so far, the newest last
    hidden: Tensor | None = None  # [1, 1, H]: the talker's last hidden state at the newest token
    position: Tensor | None = None  # [4, 1, 1]: the newest token's position ids
    step: int = 0  # entries of trailing_text_hidden consumed
    text: StreamedText | None = None  # a streamed answer's entries (else the prompt's)

    def ready(self) -> bool:
        """A streamed answer's row waits until the thinker has fed its next entry."""
        return self.text is None or self.prompt is None or self.text.available(self.step)

    def text_embed(self) -> Tensor:
        """What the next talker input adds to the codec embeddings: the next text entry."""
        assert self.prompt is not None
        if self.text is not None:
            entry = self.text.entry(self.step)
            assert entry is not None  # (parked until it is)
            return entry
        trailing = self.prompt.trailing_text_hidden
        if self.step < trailing.shape[1]:
            return trailing[:, self.step].unsqueeze(1)
        return self.prompt.tts_pad_embed


class TalkerBatch(FrameBatch[TalkerRow]):
    """The qwen3-omni talker's running requests (module docstring)."""

    def __init__(self, talker: Any, sampling: Sampling, max_frames: int) -> None:
        super().__init__()
        self.talker = talker
        self.device = talker.device
        self.predictor = talker.code_predictor
        self.max_frames = max_frames
        self.eos = int(talker.config.codec_eos_token_id)
        self.picker = RowPicker(sampling)
        temperature = getattr(self.predictor.generation_config, "temperature", None) or 1.0
        self.predictor_picker = RowPicker(
            Sampling(sampling.do_sample, temperature, PREDICTOR_TOP_K, PREDICTOR_TOP_P)
            if sampling.do_sample
            else Sampling(False)
        )

    def prefill(self, row: TalkerRow) -> Any:
        from transformers import DynamicCache

        assert row.build is not None
        prompt = row.prompt = row.build()
        positions = self._prompt_positions(prompt)
        cache = DynamicCache(config=self.talker.config.text_config)
        out = self.talker.model(
            inputs_embeds=prompt.inputs_embeds,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        logits = self.talker.codec_head(out.last_hidden_state)[:, -1]
        (token,) = self.picker.pick(logits, [[]], [row.generator])
        row.tokens = [token]
        row.hidden = out.last_hidden_state[:, -1:]
        row.position = positions[..., -1:]
        row.done = self._ends(row)
        return cache

    def decode(self, rows: list[TalkerRow], cache: PaddedCache) -> None:
        generators = [row.generator for row in rows]
        last = torch.tensor([[_tokens(row)[-1]] for row in rows], device=self.device)
        last_embed = self.talker.get_input_embeddings()(last)  # [B, 1, H]
        past_hidden = torch.cat([row.hidden for row in rows if row.hidden is not None])
        residual = self._residual_codes(past_hidden, last_embed, generators)  # [B, G-1]
        embeddings = self.predictor.get_input_embeddings()
        codec = torch.cat(
            [last_embed]
            + [embeddings[i](residual[:, i : i + 1]) for i in range(residual.shape[1])],
            dim=1,
        )
        inputs = codec.sum(1, keepdim=True) + torch.cat([row.text_embed() for row in rows])
        positions = torch.cat([row.position for row in rows if row.position is not None], dim=1)
        positions = positions + 1
        out = self.talker.model(
            inputs_embeds=inputs,
            attention_mask=cache.step_mask(),
            position_ids=positions,
            past_key_values=cache.cache,
            use_cache=True,
        )
        logits = self.talker.codec_head(out.last_hidden_state)[:, -1]
        tokens = self.picker.pick(logits, [_tokens(row) for row in rows], generators)
        cache.advanced()
        frames = torch.cat((last, residual), dim=1).cpu().numpy().astype(np.int64)
        for i, row in enumerate(rows):  # nothing failed: commit every row
            row.frames.append(frames[i])
            _tokens(row).append(tokens[i])
            row.hidden = out.last_hidden_state[i : i + 1, -1:]
            row.position = positions[:, i : i + 1]
            row.step += 1
            row.done = self._ends(row)

    def _ends(self, row: TalkerRow) -> bool:
        """generate's stopping criteria on the newest token: codec EOS or max_new_tokens."""
        tokens = _tokens(row)
        return tokens[-1] == self.eos or len(tokens) >= self.max_frames

    def _prompt_positions(self, prompt: TalkerPrompt) -> Tensor:
        """[4, 1, L] position ids of the prompt, as generate's ``_prepare_position_ids_for_
        generation`` makes them (text positions, then the three RoPE sections)."""
        length = prompt.inputs_embeds.shape[1]
        mask = torch.ones((1, length), dtype=torch.long, device=self.device)
        text = mask.cumsum(-1) - 1
        if prompt.audio_feature_lengths is not None:
            vision, _ = self.talker.get_rope_index(
                prompt.talker_input_ids,
                None,
                None,
                mask,
                False,
                prompt.audio_feature_lengths,
                None,
            )
        else:
            vision = text.unsqueeze(0).expand(3, -1, -1)
        return torch.cat([text[None, ...], vision], dim=0)

    def _residual_codes(
        self, past_hidden: Tensor, last_embed: Tensor, generators: list[torch.Generator]
    ) -> Tensor:
        """Codebooks 1..G-1 of every row's frame: the code predictor's own generate, batched
        (all rows have the same length: it restarts from a fresh cache every frame)."""
        from transformers import DynamicCache

        rows = past_hidden.shape[0]
        cache = DynamicCache(config=self.predictor.config)
        embeds = torch.cat((past_hidden, last_embed), dim=1)
        positions = torch.arange(embeds.shape[1], device=self.device).expand(rows, -1)
        out = self.predictor(
            inputs_embeds=embeds, position_ids=positions, past_key_values=cache, use_cache=True
        )
        codes = [self.predictor_picker.pick(out.logits[:, -1], [[]] * rows, generators)]
        for step in range(1, self.talker.config.num_code_groups - 1):
            positions = positions[:, -1:] + 1
            out = self.predictor(
                input_ids=torch.tensor(codes[-1], device=self.device)[:, None],
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                generation_steps=step,
            )
            codes.append(self.predictor_picker.pick(out.logits[:, -1], [[]] * rows, generators))
        return torch.tensor(codes, device=self.device).T.contiguous()


def _tokens(row: TalkerRow) -> list[int]:
    assert row.tokens is not None
    return row.tokens
