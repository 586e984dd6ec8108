"""The KV caches of a batched decode's rows as one left-padded transformers ``DynamicCache``.

Each row (a request) prefills alone into its own ``DynamicCache``; :meth:`PaddedCache.join` adds
it to the batch as the last row, padding the shorter side on the left (zeros) so every row's
newest entry sits in the last column. :attr:`PaddedCache.mask` is the [B, L] attention mask
(1: a real entry, 0: padding), which the model's ``create_causal_mask`` turns into the padding
mask; positions are never read off the cache (the decode passes each row's own position ids), so
padding moves no row's RoPE. :meth:`drop` removes a row (and the columns only padding holds).
When no row is padded, :meth:`step_mask` is ``None``: the model then runs exactly as a lone
``generate`` (no mask), so a batch of one is the monolithic computation, bit for bit.

Only full-attention ``DynamicCache`` layers are supported (a sliding window would need its own
padding rule); the cache is read and rebuilt through ``DynamicCache``'s public constructor and
iteration, and grown by the model's forward as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class PaddedCache:
    """Left-padded KV cache of the running rows, in row order (module docstring)."""

    def __init__(self) -> None:
        self.cache: Any = None  # DynamicCache over every row; None while empty
        self.mask = torch.zeros((0, 0), dtype=torch.long)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def join(self, row_cache: Any) -> None:
        """Add a row's own (unpadded, batch of one) cache as the last row."""
        if any(getattr(row_cache, "is_sliding", ())):
            raise ValueError("a batched decode needs full-attention layers (no sliding window)")
        layers = _layers(row_cache)
        keys = layers[0][0]
        length = int(keys.shape[-2])
        ones = torch.ones((1, length), dtype=torch.long, device=keys.device)
        if self.cache is None:
            self._set(layers, ones)
            return
        old = _layers(self.cache)
        width = max(length, int(self.mask.shape[1]))
        merged = [
            tuple(
                torch.cat((_left_pad(a, width), _left_pad(b, width)))
                for a, b in zip(o, n, strict=True)
            )
            for o, n in zip(old, layers, strict=True)
        ]
        self._set(merged, torch.cat((_left_pad(self.mask, width), _left_pad(ones, width))))

    def drop(self, index: int) -> None:
        """Remove row ``index``, then the leading columns that hold only padding."""
        keep = [i for i in range(self.rows) if i != index]
        if not keep:
            self.cache, self.mask = None, torch.zeros((0, 0), dtype=torch.long)
            return
        mask = self.mask[keep]
        first = int(torch.nonzero(mask.any(dim=0)).flatten()[0])
        self._set(
            [tuple(t[keep][..., first:, :] for t in kv) for kv in _layers(self.cache)],
            mask[:, first:],
        )

    def take(self, index: int) -> Any:
        """Row ``index``'s own unpadded cache (a copy), the row removed from the batch."""
        from transformers import DynamicCache

        first = int(torch.nonzero(self.mask[index]).flatten()[0])
        data = [
            tuple(t[index : index + 1, ..., first:, :].clone() for t in kv)
            for kv in _layers(self.cache)
        ]
        self.drop(index)
        return DynamicCache(ddp_cache_data=data)

    def split(self) -> list[Any]:
        """Every row's own unpadded cache, in row order (the batch is left as it was)."""
        from transformers import DynamicCache

        out = []
        for i in range(self.rows):
            first = int(torch.nonzero(self.mask[i]).flatten()[0])
            data = [tuple(t[i : i + 1, ..., first:, :] for t in kv) for kv in _layers(self.cache)]
            out.append(DynamicCache(ddp_cache_data=data))
        return out

    def step_mask(self) -> Tensor | None:
        """The mask of a one-token forward (a column of ones for the new entry); None when no
        row is padded (the unmasked path a lone ``generate`` takes)."""
        if bool(self.mask.all()):
            return None
        return torch.cat((self.mask, self.mask.new_ones((self.rows, 1))), dim=1)

    def snapshot(self) -> list[tuple[Tensor, ...]]:
        """The layers' tensors now (a forward replaces them, it never writes into them)."""
        return _layers(self.cache)

    def restore(self, snapshot: list[tuple[Tensor, ...]]) -> None:
        """Undo a forward that failed midway: the layers as :meth:`snapshot` saw them."""
        self._set(snapshot, self.mask)

    def advanced(self) -> None:
        """Record the entry the last forward appended to every row."""
        self.mask = torch.cat((self.mask, self.mask.new_ones((self.rows, 1))), dim=1)

    def _set(self, layers: list[tuple[Tensor, ...]], mask: Tensor) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = mask


def _layers(cache: Any) -> list[tuple[Tensor, ...]]:
    """(keys, values) of every layer, each [B, heads, L, head_dim]."""
    return [(keys, values) for keys, values, *_ in cache]


def _left_pad(t: Tensor, width: int) -> Tensor:
    """``t`` padded with zeros on the left of its sequence dim (-2 for KV, -1 for a mask)."""
    dim = -1 if t.ndim == 2 else -2
    short = width - t.shape[dim]
    if short == 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat((t.new_zeros(shape), t), dim=dim)
