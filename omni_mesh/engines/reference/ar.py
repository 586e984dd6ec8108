"""tiny-image stage 0, the AR model: prompt bytes → an 8x8 grid of image tokens.

A causal transformer reads the prompt's UTF-8 bytes, then generates 64 image tokens (vocabulary
512) in raster order with a KV cache; the grid conditions the DiT. Bytes and image tokens have
separate embeddings and share positions.

Input fields: ``prompt`` (str, required), ``size`` and ``steps`` (validated here for an early
error, passed through for the DiT). Output: array ``image_tokens`` int64 [8, 8]; fields ``size``,
``steps`` (when given).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.extras import extra_int
from omni_mesh.engines.fields import DEFAULT_MAX_PROMPT_BYTES, passthrough
from omni_mesh.engines.reference.common import temperature_top_k
from omni_mesh.engines.reference.dit import SIZE_RANGE, STEPS_RANGE
from omni_mesh.engines.reference.layers import (
    Block,
    BlockStack,
    KVCache,
    init_weights,
    sample,
    sinusoidal,
)
from omni_mesh.engines.torch_engine import TorchEngine

GRID = 8
IMAGE_VOCAB = 512
DIM = 512
HEADS = 8
LAYERS = 2
MLP_RATIO = 2


class ImageTokenLM(nn.Module):
    """Decoder-only transformer over [prompt bytes, BOS, image tokens]."""

    def __init__(self) -> None:
        super().__init__()
        self.text_embed = nn.Embedding(256, DIM)
        self.image_embed = nn.Embedding(IMAGE_VOCAB + 1, DIM)  # last id: BOS
        self.blocks = BlockStack(
            Block(DIM, HEADS, mlp_ratio=MLP_RATIO, causal=True) for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, IMAGE_VOCAB)

    def forward(self, x: Tensor, start: int, caches: list[KVCache]) -> Tensor:
        """Logits [IMAGE_VOCAB] after embeddings ``x`` [T, DIM] at positions ``start…``."""
        h = self.blocks(
            (x + sinusoidal(torch.arange(start, start + x.shape[0]), DIM))[None], caches
        )
        logits: Tensor = self.head(self.norm(h[0, -1:]))
        return logits


@dataclass(frozen=True)
class ArInput:
    prompt: bytes
    temperature: float
    top_k: int


class ImageArEngine(TorchEngine[ArInput]):
    """Image-token AR model (see module docstring)."""

    model: ImageTokenLM

    def build(self, seed: int) -> int:
        self.max_prompt_bytes = extra_int(
            self.ctx, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, 1, 1 << 16
        )
        self.model = ImageTokenLM().eval()
        init_weights(self.model, seed)
        return sum(p.numel() for p in self.model.parameters())

    def parse(self, request: EngineRequest) -> ArInput:
        fields = self.reader(request)
        prompt = fields.prompt_bytes("prompt", self.max_prompt_bytes)
        fields.optional_int("size", None, *SIZE_RANGE)
        fields.optional_int("steps", None, *STEPS_RANGE)
        return ArInput(prompt, *temperature_top_k(request.sampling))

    def run(
        self, request: EngineRequest, inputs: ArInput, generator: torch.Generator
    ) -> EngineResult:
        model = self.model
        count = GRID * GRID
        caches = model.blocks.new_caches(len(inputs.prompt) + count)
        text = model.text_embed(torch.tensor(list(inputs.prompt), dtype=torch.int64))
        bos = model.image_embed(torch.tensor([IMAGE_VOCAB]))
        logits = model(torch.cat([text, bos]), 0, caches)
        tokens = torch.empty(count, dtype=torch.int64)
        for i in range(count):
            tokens[i] = sample(
                logits, temperature=inputs.temperature, top_k=inputs.top_k, generator=generator
            )[0]
            if i + 1 < count:
                logits = model(
                    model.image_embed(tokens[i : i + 1]), len(inputs.prompt) + 1 + i, caches
                )
        output = StageData(
            fields=passthrough(request.data, ("size", "steps")),
            arrays={"image_tokens": tokens.view(GRID, GRID).numpy()},
        )
        return EngineResult(request.request_id, output=output)
