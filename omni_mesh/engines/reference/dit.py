"""tiny-image stage 1, the DiT: a small diffusion transformer that denoises a 64x64 RGB image.

The image (pixel space, [-1, 1]) is cut into 8x8 patches → 64 patch tokens of width 384. Each
patch token adds the embedding of the AR image token at the same grid position; two transformer
blocks with adaLN modulation from (timestep embedding + mean image-token embedding) predict the
noise. Sampling is deterministic DDIM (eta 0) over ``steps`` timesteps of a 1000-step linear beta
schedule, starting from seeded Gaussian noise; the 64x64 result is resized (bilinear, antialiased)
to ``size`` x ``size``.

Input: array ``image_tokens`` int64 [8, 8] (ids < 512); fields ``size`` (default 64, 16-512),
``steps`` (default 8, 1-200). Final: array ``image`` uint8 [size, size, 3]; fields ``width``,
``height``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.reference.common import as_tensor
from omni_mesh.engines.reference.layers import Mlp, SelfAttention, init_weights, sinusoidal
from omni_mesh.engines.torch_engine import TorchEngine

SIZE_RANGE = (16, 512)
STEPS_RANGE = (1, 200)
DEFAULT_SIZE = 64
DEFAULT_STEPS = 8
GRID = 8
TOKEN_VOCAB = 512
LATENT = 64
PATCH = LATENT // GRID
PATCH_DIM = PATCH * PATCH * 3
DIM = 384
HEADS = 6
LAYERS = 2
TRAIN_STEPS = 1000


class DitBlock(nn.Module):
    """Bidirectional transformer block whose LayerNorms are shifted and scaled by the condition."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.attn = SelfAttention(DIM, HEADS, causal=False)
        self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.mlp = Mlp(DIM, 4)
        self.modulation = nn.Linear(DIM, 6 * DIM)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (0.1 * self.modulation(cond)).chunk(6, -1)
        x = x + (1 + gate1) * self.attn(self.norm1(x) * (1 + scale1) + shift1)
        return x + (1 + gate2) * self.mlp(self.norm2(x) * (1 + scale2) + shift2)  # type: ignore[no-any-return]


class Dit(nn.Module):
    """Noise predictor: (noisy image [3, 64, 64], timestep, image tokens [64]) → noise."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_in = nn.Linear(PATCH_DIM, DIM)
        self.token_embed = nn.Embedding(TOKEN_VOCAB, DIM)
        self.time_mlp = nn.Sequential(nn.Linear(DIM, DIM), nn.SiLU(), nn.Linear(DIM, DIM))
        self.blocks = nn.ModuleList(DitBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.patch_out = nn.Linear(DIM, PATCH_DIM)
        self.register_buffer("positions", sinusoidal(torch.arange(GRID * GRID), DIM))

    def forward(self, image: Tensor, t: float, tokens: Tensor) -> Tensor:
        patches = image.reshape(3, GRID, PATCH, GRID, PATCH).permute(1, 3, 2, 4, 0)
        x = self.patch_in(patches.reshape(GRID * GRID, PATCH_DIM))
        token_emb = self.token_embed(tokens)
        x = (x + token_emb + self.positions)[None]
        cond = self.time_mlp(sinusoidal(torch.tensor([t]), DIM)) + token_emb.mean(0, keepdim=True)
        for block in self.blocks:
            x = block(x, cond[:, None])
        out: Tensor = self.patch_out(self.norm(x[0])).reshape(GRID, GRID, PATCH, PATCH, 3)
        return out.permute(4, 0, 2, 1, 3).reshape(3, LATENT, LATENT)


def ddim_timesteps(steps: int) -> list[int]:
    """``steps`` timesteps from high to low, evenly spaced over the training schedule."""
    return [int(t) for t in np.linspace(TRAIN_STEPS - 1, 0, steps).round()]


@dataclass(frozen=True)
class DitInput:
    tokens: np.ndarray
    size: int
    steps: int


class DitEngine(TorchEngine[DitInput]):
    """Diffusion transformer: image tokens → uint8 RGB image (see module docstring)."""

    model: Dit

    def build(self, seed: int) -> int:
        self.model = Dit().eval()
        init_weights(self.model, seed)
        betas = torch.linspace(1e-4, 0.02, TRAIN_STEPS, dtype=torch.float64)
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        return sum(p.numel() for p in self.model.parameters())

    def parse(self, request: EngineRequest) -> DitInput:
        fields = self.reader(request)
        tokens = fields.int_array("image_tokens", (GRID, GRID), TOKEN_VOCAB, GRID)
        size = fields.optional_int("size", DEFAULT_SIZE, *SIZE_RANGE)
        steps = fields.optional_int("steps", DEFAULT_STEPS, *STEPS_RANGE)
        assert size is not None and steps is not None
        return DitInput(tokens, size, steps)

    def run(
        self, request: EngineRequest, inputs: DitInput, generator: torch.Generator
    ) -> EngineResult:
        tokens = as_tensor(inputs.tokens).reshape(-1)
        x = torch.randn(3, LATENT, LATENT, generator=generator)
        timesteps = ddim_timesteps(inputs.steps)
        x0 = x
        for i, t in enumerate(timesteps):
            a_t = float(self.alphas_cumprod[t])
            a_prev = float(self.alphas_cumprod[timesteps[i + 1]]) if i + 1 < len(timesteps) else 1.0
            eps = self.model(x, float(t), tokens)
            x0 = ((x - (1 - a_t) ** 0.5 * eps) / a_t**0.5).clamp(-1.0, 1.0)
            eps = (x - a_t**0.5 * x0) / (1 - a_t) ** 0.5
            x = a_prev**0.5 * x0 + (1 - a_prev) ** 0.5 * eps
        image = _to_uint8(x0, inputs.size)
        final = StageData(
            fields={"width": inputs.size, "height": inputs.size}, arrays={"image": image}
        )
        return EngineResult(request.request_id, final=final)


def _to_uint8(image: Tensor, size: int) -> np.ndarray:
    """[3, 64, 64] in [-1, 1] → uint8 [size, size, 3]."""
    if size != LATENT:
        image = F.interpolate(
            image[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True
        )[0]
    pixels = ((image.clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)
    return np.ascontiguousarray(pixels.permute(1, 2, 0).numpy())
