"""GLM-Image's glyph embeddings: the quoted text of a prompt through ByT5 and the T5 encoder, as
``GlmImagePipeline._get_glyph_embeds`` makes them for one prompt (the texts in '…', “…”, "…" and
「…」; none gives the empty text, the negative prompt's embeddings)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

_QUOTES = (
    re.compile(r"'([^']*)'"),
    re.compile(r"\u201c([^\u201c\u201d]*)\u201d"),
    re.compile(r'"([^"]*)"'),
    re.compile(r"「([^「」]*)」"),
)
MAX_SEQUENCE_LENGTH = 2048  # the pipeline's default max_sequence_length


def glyph_texts(prompt: str) -> list[str]:
    """The texts a prompt asks to draw, in the pipeline's order (by kind of quote)."""
    return [text for quote in _QUOTES for text in quote.findall(prompt)]


class GlyphEncoder:
    """The T5 encoder and its ByT5 tokenizer of a glm-image DiT stage."""

    def __init__(self, tokenizer: Any, encoder: Any, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.device = device

    def embed(self, prompt: str, dtype: torch.dtype) -> Tensor:
        """[1, S, D] embeddings of ``prompt``'s glyph texts ("" for the negative prompt)."""
        texts = glyph_texts(prompt) or [""]
        pad = self.tokenizer.pad_token_id
        ids = self.tokenizer(texts, max_length=MAX_SEQUENCE_LENGTH, truncation=True).input_ids
        # the pipeline's padding: one pad in front of every text when their count is even
        ids = [[pad] * ((len(ids) + 1) % 2) + row for row in ids]
        longest = max(len(row) for row in ids)
        mask = torch.tensor(
            [[1] * len(row) + [0] * (longest - len(row)) for row in ids], device=self.device
        )
        tokens = torch.tensor(
            [row + [pad] * (longest - len(row)) for row in ids], device=self.device
        )
        hidden: Tensor = self.encoder(tokens, attention_mask=mask).last_hidden_state
        return hidden[mask.bool()].unsqueeze(0).to(device=self.device, dtype=dtype)
