"""Shared building blocks of the reference models: seeding, KV cache, sampling."""

from __future__ import annotations

import pytest
import torch

from omni_mesh.engines.reference.layers import Block, BlockStack, init_weights, sample
from omni_mesh.engines.seeds import derive_seed, make_generator

pytestmark = pytest.mark.unit


def stack() -> BlockStack:
    return BlockStack(Block(64, 4, causal=True, cross=True) for _ in range(2))


def test_derive_seed_is_stable_and_distinct() -> None:
    assert derive_seed("tiny-omni", "thinker") == derive_seed("tiny-omni", "thinker")
    assert derive_seed("tiny-omni", "talker") != derive_seed("tiny-tts", "talker")
    assert 0 <= derive_seed("x") < 2**63


def test_init_weights_depends_only_on_the_seed() -> None:
    a, b, c = stack(), stack(), stack()
    torch.manual_seed(123)  # the global RNG must not matter
    init_weights(a, 1)
    init_weights(b, 1)
    init_weights(c, 2)
    pairs = list(zip(a.parameters(), b.parameters(), c.parameters(), strict=True))
    assert all(torch.equal(pa, pb) for pa, pb, _ in pairs)
    assert not all(torch.equal(pa, pc) for pa, _, pc in pairs)


def test_incremental_decoding_matches_one_pass() -> None:
    blocks = stack()
    init_weights(blocks, 5)
    x = torch.randn(1, 9, 64, generator=make_generator(0))
    memory = torch.randn(1, 5, 64, generator=make_generator(1))
    with torch.inference_mode():
        kv = blocks.memory_kv(memory)
        full = blocks(x, blocks.new_caches(9), kv)
        caches = blocks.new_caches(9)
        steps = [blocks(x[:, :4], caches, kv)] + [
            blocks(x[:, i : i + 1], caches, kv) for i in range(4, 9)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_sample_respects_masks_greedy_and_top_k() -> None:
    logits = torch.tensor([[0.0, 5.0, float("-inf"), 4.0]])
    assert sample(logits, temperature=0.0, top_k=0, generator=make_generator(0)).tolist() == [1]
    draws = {
        int(sample(logits, temperature=1.0, top_k=2, generator=make_generator(s))[0])
        for s in range(50)
    }
    assert draws == {1, 3}
    a = sample(torch.zeros(4, 100), temperature=1.0, top_k=0, generator=make_generator(9))
    b = sample(torch.zeros(4, 100), temperature=1.0, top_k=0, generator=make_generator(9))
    assert torch.equal(a, b) and a.shape == (4,)
