"""Token logprobs of a text output, and their OpenAI shapes (as vLLM's own server writes them).

A vLLM text stage gives, per token, the dict of alternatives vLLM keeps: the token itself first,
then the top k (see ``omni_mesh/engines/vllm/stream.py`` for the wire form: float arrays, token
strings as JSON text). :class:`TokenLogprobs` holds them decoded, joins chunks, and shapes them:
chat's ``logprobs.content`` (``top_logprobs``: the first k entries of each dict) and completions'
``{tokens, token_logprobs, top_logprobs, text_offset}`` (``top_logprobs``: the first k+1
entries, as a token → logprob map). Logprobs are floored at -9999 (JSON has no -inf), as vLLM's
server floors them. Reference engines give none: the answer's ``logprobs`` is then null.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_mesh.data_plane.messages import Scalar

#: The text output's fields that carry logprobs' token strings (not shown as plain fields).
LOGPROB_FIELDS = ("logprob_tokens", "prompt_logprob_tokens")
_FLOOR = -9999.0


def _floor(value: float) -> float:
    return max(value, _FLOOR)


@dataclass
class TokenLogprobs:
    """Per token: its text, its logprob (None: the prompt's first token) and the alternatives
    (token, logprob) in vLLM's order, the token itself first (None: the prompt's first)."""

    tokens: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[str, float]] | None] = field(default_factory=list)

    @classmethod
    def read(
        cls, fields: Mapping[str, Scalar], arrays: Mapping[str, np.ndarray], prefix: str = ""
    ) -> TokenLogprobs | None:
        """From a final output's ``{prefix}logprobs`` arrays and token strings (None when the
        engine gave none; a malformed set is dropped the same way)."""
        sampled = arrays.get(f"{prefix}logprobs")
        if sampled is None:
            return None
        values = [float(x) for x in sampled.reshape(-1)]
        top = arrays.get(f"{prefix}top_logprobs")
        raw = fields.get(f"{prefix}logprob_tokens")
        try:
            names = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            names = None
        if top is None or names is None or len(names) != len(values) or top.ndim != 2:
            # Only the sampled tokens' logprobs (an engine without alternatives).
            return cls([""] * len(values), [_none_if_nan(v) for v in values], [None] * len(values))
        out = cls()
        for i, value in enumerate(values):
            row = [str(t) for t in names[i]]
            out.tokens.append(row[0] if row else "")
            out.logprobs.append(_none_if_nan(value))
            pairs = [(t, float(top[i, j])) for j, t in enumerate(row) if j < top.shape[1]]
            out.top.append(None if math.isnan(value) else pairs)
        return out

    @classmethod
    def join(cls, parts: Sequence[TokenLogprobs | None]) -> TokenLogprobs | None:
        have = [p for p in parts if p is not None]
        if not have:
            return None
        return cls(
            [t for p in have for t in p.tokens],
            [v for p in have for v in p.logprobs],
            [r for p in have for r in p.top],
        )

    def __add__(self, other: TokenLogprobs) -> TokenLogprobs:
        return TokenLogprobs(
            self.tokens + other.tokens, self.logprobs + other.logprobs, self.top + other.top
        )

    # ---- OpenAI shapes -------------------------------------------------------------------

    def chat(self, top_logprobs: int) -> dict[str, Any]:
        """Chat's ``choices[i].logprobs``: ``{"content": [...]}``."""
        content = []
        for token, value, top in zip(self.tokens, self.logprobs, self.top, strict=True):
            alternatives = [
                {"token": t, "logprob": _floor(v), "bytes": _bytes(t)}
                for t, v in (top or [])[:top_logprobs]
            ]
            content.append(
                {
                    "token": token,
                    "logprob": _floor(value if value is not None else _FLOOR),
                    "bytes": _bytes(token),
                    "top_logprobs": alternatives,
                }
            )
        return {"content": content}

    def completion(self, logprobs: int, text_offset: int = 0) -> dict[str, Any]:
        """Completions' ``choices[i].logprobs``; offsets start at ``text_offset``."""
        offsets: list[int] = []
        top_maps: list[dict[str, float] | None] = []
        for i, top in enumerate(self.top):
            offsets.append(text_offset if i == 0 else offsets[-1] + len(self.tokens[i - 1]))
            top_maps.append(None if top is None else {t: _floor(v) for t, v in top[: logprobs + 1]})
        return {
            "tokens": list(self.tokens),
            "token_logprobs": [None if v is None else _floor(v) for v in self.logprobs],
            "top_logprobs": top_maps,
            "text_offset": offsets,
        }

    def next_offset(self, text_offset: int) -> int:
        """The text offset after these tokens (a stream's next chunk starts there)."""
        return text_offset + sum(len(t) for t in self.tokens)


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
