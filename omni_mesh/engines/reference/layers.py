"""Neural-network building blocks shared by the reference models.

Pre-LayerNorm transformer blocks (causal or bidirectional self-attention, optional
cross-attention, GELU MLP) with a preallocated KV cache for one sequence, sinusoidal position and
timestep embeddings, seeded weight initialisation and seeded sampling.

Everything here is deterministic: weights come from :func:`init_weights` with an explicit seed
(never the global RNG), and sampling draws only from the ``torch.Generator`` it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_mesh.engines.moved import moved_name
from omni_mesh.engines.seeds import make_generator


@torch.no_grad()
def init_weights(module: nn.Module, seed: int) -> None:
    """Overwrite every parameter of ``module`` from a generator seeded with ``seed``.

    Scaled-normal weights (std 1/sqrt(fan-in)) keep activations near unit variance through the
    random, untrained networks. The result depends only on ``seed`` and the module's structure.
    """
    gen = make_generator(seed)
    done: set[int] = set()
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in done:
                continue
            done.add(id(param))
            param.copy_(_initial_value(sub, name, param, gen))


def _initial_value(sub: nn.Module, name: str, param: Tensor, gen: torch.Generator) -> Tensor:
    if name == "bias":
        return torch.zeros_like(param)
    if isinstance(sub, nn.LayerNorm):
        return torch.ones_like(param)
    if isinstance(sub, nn.Embedding):
        std = 1.0
    elif isinstance(sub, nn.ConvTranspose1d):
        # weight [in, out, k]; each output sample sees in * k / stride inputs
        std = 1.0 / math.sqrt(param.shape[0] * param.shape[2] / sub.stride[0])
    elif param.ndim >= 2:  # Linear [out, in], Conv1d [out, in, k]
        std = 1.0 / math.sqrt(param[0].numel())
    else:
        std = 0.02
    return torch.randn(param.shape, generator=gen, dtype=param.dtype) * std


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def sinusoidal(positions: Tensor, dim: int, max_period: float = 10_000.0) -> Tensor:
    """Sinusoidal embedding of (possibly fractional) positions or timesteps: [N] -> [N, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class KVCache:
    """Keys and values of one sequence for one attention layer, preallocated to ``capacity``."""

    def __init__(self, num_heads: int, head_dim: int, capacity: int) -> None:
        self.k = torch.empty(1, num_heads, capacity, head_dim)
        self.v = torch.empty(1, num_heads, capacity, head_dim)
        self.length = 0

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        n = int(k.shape[2])
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


def _split_heads(x: Tensor, num_heads: int) -> Tensor:
    b, t, d = x.shape
    return x.view(b, t, num_heads, d // num_heads).transpose(1, 2)


def _merge_heads(x: Tensor) -> Tensor:
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


class SelfAttention(nn.Module):
    """Multi-head self-attention; with a cache, either a prefill from empty or one-token steps."""

    def __init__(self, dim: int, num_heads: int, *, causal: bool) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        q, k, v = (_split_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        is_causal = self.causal and x.shape[1] > 1
        if cache is not None:
            if x.shape[1] > 1 and cache.length:
                raise RuntimeError("multi-token step on a non-empty KV cache is not supported")
            k, v = cache.append(k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return self.out(_merge_heads(y))  # type: ignore[no-any-return]


class CrossAttention(nn.Module):
    """Attention from a sequence to a fixed memory (keys/values projected once per request)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv(memory).chunk(2, dim=-1)
        return _split_heads(k, self.num_heads), _split_heads(v, self.num_heads)

    def forward(self, x: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        q = _split_heads(self.q(x), self.num_heads)
        y = F.scaled_dot_product_attention(q, kv[0], kv[1])
        return self.out(_merge_heads(y))  # type: ignore[no-any-return]


class Mlp(nn.Sequential):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__(nn.Linear(dim, ratio * dim), nn.GELU(), nn.Linear(ratio * dim, dim))


class Block(nn.Module):
    """Pre-LN transformer block: self-attention, optional cross-attention, MLP."""

    def __init__(
        self, dim: int, num_heads: int, *, mlp_ratio: int = 4, causal: bool, cross: bool = False
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads, causal=causal)
        self.norm_cross = nn.LayerNorm(dim) if cross else None
        self.cross = CrossAttention(dim, num_heads) if cross else None
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_ratio)

    def forward(
        self,
        x: Tensor,
        cache: KVCache | None = None,
        memory_kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        x = x + self.attn(self.norm1(x), cache)
        if self.cross is not None and self.norm_cross is not None:
            if memory_kv is None:
                raise RuntimeError("cross-attention block called without memory")
            x = x + self.cross(self.norm_cross(x), memory_kv)
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]

    def new_cache(self, capacity: int) -> KVCache:
        heads = self.attn.num_heads
        dim = self.norm1.normalized_shape[0]
        return KVCache(heads, dim // heads, capacity)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        if self.cross is None:
            raise RuntimeError("block has no cross-attention")
        return self.cross.memory_kv(memory)


class BlockStack(nn.ModuleList):
    """Blocks applied in sequence; each keeps its own KV cache and cross-attention memory."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        super().__init__(blocks)

    def typed(self) -> list[Block]:
        return [cast(Block, block) for block in self]

    def new_caches(self, capacity: int) -> list[KVCache]:
        return [block.new_cache(capacity) for block in self.typed()]

    def memory_kv(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        return [block.memory_kv(memory) for block in self.typed()]

    def forward(
        self,
        x: Tensor,
        caches: list[KVCache] | None = None,
        memory_kv: list[tuple[Tensor, Tensor]] | None = None,
    ) -> Tensor:
        for i, block in enumerate(self.typed()):
            x = block(x, caches[i] if caches else None, memory_kv[i] if memory_kv else None)
        return x


def sample(logits: Tensor, *, temperature: float, top_k: int, generator: torch.Generator) -> Tensor:
    """Draw one index per row of ``logits`` [R, V] -> int64 [R]; greedy when temperature is 0.

    Masked entries (``-inf``) are never drawn."""
    logits = logits.to(torch.float32)
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


#: What this module held before the seeds got a module of their own (issue 32).
_MOVED = {
    "derive_seed": ("omni_mesh.engines.seeds", "derive_seed"),
    "SEED_MASK": ("omni_mesh.engines.seeds", "SEED_MASK"),
}


def __getattr__(name: str) -> object:
    return moved_name(__name__, name, _MOVED)
