"""tiny-omni stage 0, the thinker: a byte-level causal transformer language model.

Reads the prompt's UTF-8 bytes (vocabulary 256), generates ``max_tokens`` new bytes restricted to
printable ASCII with a KV cache, and returns the generated text (the stage's final output) plus
the last-layer hidden states of every prompt and generated token, which condition the talker.

Input fields: ``prompt`` (str, required), ``max_tokens`` (int, default 32, capped by
``sampling.max_tokens``; ``sampling.max_tokens`` alone also sets it), ``voice`` (checked against
the talker's voices, passed through). Output fields: ``text``, ``voice``, ``prompt_tokens``,
``generated_tokens``; arrays: ``hidden_states`` float32 [T, 1024], ``token_ids`` int64 [T]
(T = prompt + generated tokens). Final: ``text``. Sampling: the request's temperature / top_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.extras import extra_int
from omni_mesh.engines.fields import DEFAULT_MAX_PROMPT_BYTES, passthrough
from omni_mesh.engines.reference.common import sampling_or_default, temperature_top_k, voice_index
from omni_mesh.engines.reference.layers import (
    Block,
    BlockStack,
    KVCache,
    init_weights,
    sample,
    sinusoidal,
)
from omni_mesh.engines.torch_engine import TorchEngine

VOCAB = 256
HIDDEN = 1024
HEADS = 8
LAYERS = 2
MLP_RATIO = 2
DEFAULT_MAX_TOKENS = 32
PRINTABLE = range(32, 127)
#: Sharpens the random LM head so the text depends visibly on the prompt.
LOGIT_SCALE = 4.0


class ByteLM(nn.Module):
    """Decoder-only transformer over bytes with sinusoidal positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = BlockStack(
            Block(HIDDEN, HEADS, mlp_ratio=MLP_RATIO, causal=True) for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: Tensor, start: int, caches: list[KVCache]) -> Tensor:
        """Hidden states [T, HIDDEN] of ``ids`` [T] placed at positions ``start…``."""
        positions = torch.arange(start, start + ids.shape[0])
        x = (self.embed(ids) + sinusoidal(positions, HIDDEN))[None]
        hidden: Tensor = self.norm(self.blocks(x, caches))[0]
        return hidden


@dataclass(frozen=True)
class ThinkerInput:
    prompt: bytes
    max_tokens: int
    temperature: float
    top_k: int


class ThinkerEngine(TorchEngine[ThinkerInput]):
    """Byte-level LM: prompt → printable text + hidden states (see module docstring)."""

    model: ByteLM

    def build(self, seed: int) -> int:
        self.max_prompt_bytes = extra_int(
            self.ctx, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, 1, 1 << 16
        )
        self.max_tokens_limit = extra_int(self.ctx, "max_tokens_limit", 512, 1, 8192)
        self.model = ByteLM().eval()
        init_weights(self.model, seed)
        allowed = torch.full((VOCAB,), float("-inf"))
        allowed[list(PRINTABLE)] = 0.0
        self.printable_mask = allowed
        return sum(p.numel() for p in self.model.parameters())

    def parse(self, request: EngineRequest) -> ThinkerInput:
        fields = self.reader(request)
        prompt = fields.prompt_bytes("prompt", self.max_prompt_bytes)
        voice_index(fields)  # the talker's; checked here so a bad voice costs no compute
        sampling = sampling_or_default(request.sampling)
        requested = fields.optional_int("max_tokens", None, 1, 8192)
        if requested is None:
            requested = sampling.max_tokens or DEFAULT_MAX_TOKENS
        elif sampling.max_tokens is not None:
            requested = min(requested, sampling.max_tokens)
        if requested > self.max_tokens_limit:
            raise fields.error(
                "field",
                "max_tokens",
                f"is {requested}; this stage generates at most {self.max_tokens_limit} "
                "(engine_extras.max_tokens_limit)",
            )
        return ThinkerInput(prompt, requested, *temperature_top_k(request.sampling))

    def run(
        self, request: EngineRequest, inputs: ThinkerInput, generator: torch.Generator
    ) -> EngineResult:
        prompt_ids = torch.tensor(list(inputs.prompt), dtype=torch.int64)
        caches = self.model.blocks.new_caches(len(inputs.prompt) + inputs.max_tokens)
        hidden = [self.model(prompt_ids, 0, caches)]
        generated: list[int] = []
        for _ in range(inputs.max_tokens):
            logits = self.model.head(hidden[-1][-1:]) * LOGIT_SCALE + self.printable_mask
            token = sample(
                logits, temperature=inputs.temperature, top_k=inputs.top_k, generator=generator
            )
            generated.append(int(token[0]))
            position = len(inputs.prompt) + len(generated) - 1
            hidden.append(self.model(token, position, caches))
        text = bytes(generated).decode("ascii")
        ids = np.concatenate([np.frombuffer(inputs.prompt, np.uint8), np.array(generated)])
        output = StageData(
            fields={
                "text": text,
                "prompt_tokens": len(inputs.prompt),
                "generated_tokens": len(generated),
                **passthrough(request.data, ("voice",)),
            },
            arrays={
                "hidden_states": torch.cat(hidden).numpy(),
                "token_ids": ids.astype(np.int64),
            },
        )
        return EngineResult(request.request_id, output=output, final=StageData({"text": text}))
