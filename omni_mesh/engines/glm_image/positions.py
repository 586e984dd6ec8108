"""GLM-Image's 3D rope positions of a text-to-image request: the prompt's and the decode's.

As ``GlmImageModel.get_rope_index`` makes them for a prompt without source images: the prompt's
L tokens sit at position i on all three axes (temporal, height, width); the decode then writes the
grids in reverse order of the processor's ``image_grid_thw`` (the preview grid first, then the
target grid), grid (h, w) at temporal ``p``, height ``p + row``, width ``p + column`` where ``p``
starts at L and moves on by ``max(h, w)`` after each grid; one last position ``p`` (all axes) for
the token after the grids. The model keeps these per call (``_cached_decode_position_ids``); an
engine that passes them explicitly owns them per request instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


def prompt_positions(length: int, device: torch.device) -> Tensor:
    """[3, 1, L] positions of a prompt of ``length`` tokens."""
    return torch.arange(length, device=device).view(1, 1, -1).expand(3, 1, -1).clone()


def decode_positions(length: int, grids: list[tuple[int, int]], device: torch.device) -> Tensor:
    """[3, N] positions of the N = sum(h * w) + 1 decoded tokens after a prompt of ``length``
    tokens, for the target grids (h, w) in the processor's order (module docstring)."""
    start = length
    parts: list[Tensor] = []
    for h, w in reversed(grids):
        rows = torch.arange(h, device=device).repeat_interleave(w)
        cols = torch.arange(w, device=device).repeat(h)
        temporal = torch.full((h * w,), start, device=device, dtype=torch.long)
        parts.append(torch.stack([temporal, start + rows, start + cols]))
        start += max(h, w)
    parts.append(torch.full((3, 1), start, device=device, dtype=torch.long))
    return torch.cat(parts, dim=1)
