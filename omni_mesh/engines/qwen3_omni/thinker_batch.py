"""Qwen3-Omni's thinker decoded for many requests at once: one batched forward of the MoE LM per
token, for every running request.

It is ``Qwen3OmniMoeThinkerForConditionalGeneration.generate`` unrolled, step for step, as the
thinker engine called it alone (``output_hidden_states``, ``<|im_end|>`` as EOS):

* prefill (each request alone, :attr:`FrameBatch.prefill_frames`: it gives the first token):
  the chat-templated ``input_ids`` (with audio input, the audio encoder's features scattered
  over the audio placeholders by the model's own forward) at the 4-row positions generate's
  ``_prepare_position_ids_for_generation`` makes: text positions, then the three multimodal RoPE
  sections of ``get_rope_index``;
* each step: every row's newest token at its positions + 1 (so each row keeps its own
  ``rope_deltas``, the gap between its RoPE and text positions), in one forward over the rows'
  left-padded KV cache (``padded_cache``); each row's token comes from the last logits through
  ``generate``'s processors for the row's own sampling (``row_sampling``, its own generator;
  no repetition penalty: the thinker's requests have none);
* a row ends on ``<|im_end|>`` or after its ``max_tokens`` tokens; the forward of the last token
  never runs (as generate stops).

Every forward's input embeddings (``hidden_states[0]``) and ``accept_hidden_layer`` hidden
states are kept per row: the talker's ``thinker_embed`` and ``thinker_hidden``, one entry per
position the thinker ran. A batch of one is the lone ``generate``'s exact computation (no mask:
``PaddedCache.step_mask``). In a larger batch the kernels (the padding mask, a matmul over B rows)
may move values in their last float bits; the tests measure it (``test_qwen3_omni_thinker_
batching``) and hold the tokens equal to each request's alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_mesh.engines.batching.frame_batch import FrameBatch, Row
from omni_mesh.engines.batching.padded_cache import PaddedCache
from omni_mesh.engines.batching.row_sampling import RowPicker, Sampling
from omni_mesh.engines.qwen3_omni.answer import AnswerChunks, TextDeltas
from omni_mesh.engines.qwen3_omni.inputs import ThinkerPrompt

GREEDY = Sampling(False)
POSITION_DTYPES = (torch.int64, torch.float32)


@dataclass(eq=False)
class ThinkerRow(Row):
    """A request in the thinker's batch. ``frames`` holds its tokens, one int64 [1] each."""

    prompt: ThinkerPrompt | None = None
    sampling: Sampling = GREEDY
    max_tokens: int = 1
    voice: str = ""  # handed on to the talker
    tokens: list[int] = field(default_factory=list)  # generated so far, the newest last
    text: TextDeltas | None = None  # the text streamed to the client (made by the engine)
    embeds: list[Tensor] = field(default_factory=list)  # [L, D] per forward: hidden_states[0]
    hidden: list[Tensor] = field(default_factory=list)  # [L, D]: the accept layer's
    position: Tensor | None = None  # [4, 1, 1]: the newest forward's last position ids
    handoff: AnswerChunks | None = None  # the answer handed on as it is made (streamed input)
    handoff_items: int = 0  # entries of ``embeds``/``hidden`` handed on so far


class ThinkerBatch(FrameBatch[ThinkerRow]):
    """The qwen3-omni thinker's running requests (module docstring)."""

    prefill_frames = True

    def __init__(self, thinker: Any, eos: int, accept_layer: int) -> None:
        super().__init__()
        self.thinker = thinker
        self.device = thinker.device
        self.eos = eos
        self.accept_layer = accept_layer
        self._pickers: dict[Sampling, RowPicker] = {}

    def prefill(self, row: ThinkerRow) -> Any:
        from transformers import DynamicCache

        prompt = row.prompt
        assert prompt is not None
        input_ids = prompt.input_ids.to(self.device)
        extra: dict[str, Any] = {}
        features, feature_mask = prompt.input_features, prompt.feature_attention_mask
        if features is not None and feature_mask is not None:
            extra["input_features"] = features.to(self.device, self.thinker.dtype)
            extra["feature_attention_mask"] = feature_mask.to(self.device)
        positions = self._prompt_positions(input_ids, prompt)
        cache = DynamicCache(config=self.thinker.config.text_config)
        out = self.thinker(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
            use_audio_in_video=False,
            **extra,
        )
        (token,) = self._pick(out.logits[:, -1], [row])
        self._commit(row, token, out.hidden_states, 0, positions[..., -1:])
        return cache

    def decode(self, rows: list[ThinkerRow], cache: PaddedCache) -> None:
        input_ids = torch.tensor([[row.tokens[-1]] for row in rows], device=self.device)
        positions = torch.cat([row.position for row in rows if row.position is not None], dim=1)
        positions = positions + 1
        out = self.thinker(
            input_ids=input_ids,
            attention_mask=cache.step_mask(),
            position_ids=positions,
            past_key_values=cache.cache,
            use_cache=True,
            output_hidden_states=True,
            use_audio_in_video=False,
        )
        tokens = self._pick(out.logits[:, -1], rows)
        cache.advanced()
        for i, row in enumerate(rows):  # nothing failed: commit every row
            self._commit(row, tokens[i], out.hidden_states, i, positions[:, i : i + 1])

    def held(self, row: ThinkerRow, row_cache: Any) -> dict[str, Tensor]:
        """The row after its prefill (one token): its token, positions, generator and the
        prompt's input embeddings and accept-layer hidden states, and the cache's layers."""
        state = {
            "tokens": torch.tensor(row.tokens, dtype=torch.int64),
            "position": _tensor(row.position),
            "generator": row.generator.get_state(),
            "embeds": torch.cat(row.embeds),
            "hidden": torch.cat(row.hidden),
        }
        for i, (keys, values, *_) in enumerate(row_cache):
            state[f"k{i}"], state[f"v{i}"] = keys, values
        return state

    def token_bytes(self) -> int:
        """Bytes :meth:`held` takes per prompt token: every layer's key and value, the input
        embedding and the accept layer's hidden state."""
        text = self.thinker.config.text_config
        width = int(text.hidden_size)
        head_dim = int(getattr(text, "head_dim", None) or width // text.num_attention_heads)
        kv = 2 * int(text.num_hidden_layers) * int(text.num_key_value_heads) * head_dim
        return (kv + 2 * width) * int(self.thinker.dtype.itemsize)

    def restore(self, row: ThinkerRow, state: dict[str, Tensor]) -> Any:
        """:meth:`held`'s tensors back into ``row`` (parsed here from the same request) and its
        cache. A state of another prompt, model, dtype or shape raises before the row
        changes."""
        from transformers import DynamicCache

        assert row.prompt is not None
        text = self.thinker.config.text_config
        layers = int(text.num_hidden_layers)
        length, width = int(row.prompt.input_ids.shape[-1]), int(text.hidden_size)
        heads = int(text.num_key_value_heads)
        head_dim = int(getattr(text, "head_dim", None) or width // text.num_attention_heads)
        dtype = self.thinker.dtype
        kv_names = {f"{kind}{i}" for i in range(layers) for kind in "kv"}
        if set(state) != {"tokens", "position", "generator", "embeds", "hidden"} | kv_names:
            raise ValueError(f"the prefill state has tensors {sorted(state)}")
        generator = row.generator.get_state()
        _expect(state["tokens"], (1,), torch.int64, "tokens")
        position = state["position"]  # get_rope_index's dtype (float32 in transformers 5)
        if tuple(position.shape) != (4, 1, 1) or position.dtype not in POSITION_DTYPES:
            raise ValueError(f"the prefill state's position is {position.dtype} {position.shape}")
        _expect(state["generator"], tuple(generator.shape), generator.dtype, "generator")
        _expect(state["embeds"], (length, width), dtype, "embeds (another prompt?)")
        _expect(state["hidden"], (length, width), dtype, "hidden (another prompt?)")
        for name in kv_names:
            _expect(state[name], (1, heads, length, head_dim), dtype, name)
        token = int(state["tokens"][0])
        if not 0 <= token < int(text.vocab_size):
            raise ValueError(f"the prefill state's token {token} is not in the vocabulary")
        device = self.device
        embeds, hidden = state["embeds"].to(device), state["hidden"].to(device)
        position = position.to(device)
        kv = [(state[f"k{i}"].to(device), state[f"v{i}"].to(device)) for i in range(layers)]
        cache = DynamicCache(ddp_cache_data=kv)
        # everything built: the row changes only now
        row.generator.set_state(state["generator"])
        row.embeds.append(embeds)
        row.hidden.append(hidden)
        row.position = position
        row.tokens.append(token)
        row.frames.append(np.array([token], dtype=np.int64))
        row.done = token == self.eos or len(row.tokens) >= row.max_tokens
        return cache

    def _commit(
        self, row: ThinkerRow, token: int, states: tuple[Tensor, ...], index: int, position: Tensor
    ) -> None:
        """Row ``index`` of a forward's outputs into ``row``, with its new ``token``."""
        # copies: a view of row ``index`` would keep the whole batch's tensor alive
        row.embeds.append(states[0][index].clone())
        row.hidden.append(states[self.accept_layer][index].clone())
        row.position = position
        row.tokens.append(token)
        row.frames.append(np.array([token], dtype=np.int64))
        row.done = token == self.eos or len(row.tokens) >= row.max_tokens

    def _pick(self, logits: Tensor, rows: list[ThinkerRow]) -> list[int]:
        """Each row's token from its logits [B, V], the rows grouped by their sampling."""
        groups: dict[Sampling, list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            groups[row.sampling].append(i)
        tokens = [0] * len(rows)
        for sampling, indices in groups.items():
            picker = self._pickers.get(sampling)
            if picker is None:
                picker = self._pickers[sampling] = RowPicker(sampling)
            chosen = picker.pick(
                logits[indices], [[]] * len(indices), [rows[i].generator for i in indices]
            )
            for i, token in zip(indices, chosen, strict=True):
                tokens[i] = token
        return tokens

    def _prompt_positions(self, input_ids: Tensor, prompt: ThinkerPrompt) -> Tensor:
        """[4, 1, L] position ids of the prompt, as generate's ``_prepare_position_ids_for_
        generation`` makes them (text positions, then the three RoPE sections)."""
        mask = prompt.attention_mask.to(self.device)
        text = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        lengths = None
        if prompt.feature_attention_mask is not None:
            lengths = prompt.feature_attention_mask.sum(-1).to(self.device)
        vision, _ = self.thinker.get_rope_index(input_ids, None, None, mask, False, lengths, None)
        return torch.cat([text[None, ...], vision], dim=0)


def _expect(t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(
            f"the prefill state's {name} is {t.dtype} {tuple(t.shape)}, not {dtype} {shape}"
        )


def _tensor(t: Tensor | None) -> Tensor:
    assert t is not None
    return t
