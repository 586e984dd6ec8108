"""Seeds that are the same on every host: weights from a pipeline's and stage's names, a
request's draws from its seed (so a replay on any replica gives the same bytes, DESIGN §3)."""

from __future__ import annotations

import hashlib

import torch

SEED_MASK = (1 << 63) - 1


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (same on every host and Python run)."""
    text = "\x1f".join(str(p) for p in parts)
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & SEED_MASK


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed & SEED_MASK)
    return gen
