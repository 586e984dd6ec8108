"""The talker (tiny-omni stage 1, tiny-tts stage 0): an AR model over codec frames.

Each step predicts one frame of 4 codebooks (1024 codes each) with 4 parallel heads from a causal
transformer whose input is the sum of the previous frame's codebook embeddings, a speaker
embedding and a position. Every block cross-attends to a conditioning memory:

* after the thinker (tiny-omni): its hidden states, float32 [T, 1024], projected to the model
  width; frames = 2 x ``text_tokens`` (the thinker's generated tokens);
* as the entry stage (tiny-tts): the prompt's UTF-8 bytes, embedded and encoded by one
  bidirectional block; frames = 2 x prompt bytes, capped by ``max_tokens`` when given.

Both are capped by ``engine_extras.max_frames`` (default 256, 20.5 s of audio). Codes are sampled
with ``engine_extras.temperature`` / ``top_k`` (0.9 / 64); as the entry stage the request's
sampling params apply when given (after the thinker they address the text model, not this one).

Input fields: ``voice`` (one of :data:`VOICES`, default ``"default"``) and either
``text_tokens`` + array ``hidden_states`` or ``prompt`` (+ ``max_tokens``). Output: array
``codes`` int64 [F, 4]; fields ``num_frames``, ``voice``.

Streaming (``async_chunk``, whole input): the same sampling loop yields a chunk every
``engine_extras.chunk_frames`` frames (default 10): array ``codes`` [n, 4] (the chunk's new
frames), fields ``num_frames`` (n), ``voice`` and ``frame_offset`` (frames before the chunk),
and, except on chunk 0, array ``context_codes`` [m, 4], the m = min(CONTEXT_FRAMES,
frame_offset) frames just before the chunk that code2wav needs to decode it seamlessly. The
chunks' ``codes`` concatenated are the whole output's ``codes``, byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.extras import extra_float, extra_int
from omni_mesh.engines.fields import DEFAULT_MAX_PROMPT_BYTES, FieldReader
from omni_mesh.engines.reference.codec import CODEBOOK_SIZE, CONTEXT_FRAMES, NUM_CODEBOOKS
from omni_mesh.engines.reference.common import VOICES, as_tensor, temperature_top_k, voice_index
from omni_mesh.engines.reference.layers import (
    Block,
    BlockStack,
    KVCache,
    init_weights,
    sample,
    sinusoidal,
)
from omni_mesh.engines.reference.thinker import HIDDEN as THINKER_HIDDEN
from omni_mesh.engines.torch_engine import TorchEngine

__all__ = ["CODEBOOK_SIZE", "NUM_CODEBOOKS", "TalkerEngine", "TalkerInput", "TalkerModel"]

FRAMES_PER_TOKEN = 2
DIM = 512
HEADS = 8
LAYERS = 2
MLP_RATIO = 2
MAX_CONDITION_TOKENS = 1 << 16


class TalkerModel(nn.Module):
    """Frame decoder with cross-attention, a byte text encoder and a hidden-state adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.text_embed = nn.Embedding(256, DIM)
        self.text_encoder = Block(DIM, HEADS, mlp_ratio=MLP_RATIO, causal=False)
        self.adapter = nn.Sequential(nn.LayerNorm(THINKER_HIDDEN), nn.Linear(THINKER_HIDDEN, DIM))
        self.speaker = nn.Embedding(len(VOICES), DIM)
        self.bos = nn.Embedding(1, DIM)
        self.codebooks = nn.ModuleList(
            nn.Embedding(CODEBOOK_SIZE, DIM) for _ in range(NUM_CODEBOOKS)
        )
        self.blocks = BlockStack(
            Block(DIM, HEADS, mlp_ratio=MLP_RATIO, causal=True, cross=True) for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(DIM)
        self.heads = nn.Linear(DIM, NUM_CODEBOOKS * CODEBOOK_SIZE)

    def encode_text(self, data: bytes) -> Tensor:
        ids = torch.tensor(list(data), dtype=torch.int64)
        x = self.text_embed(ids) + sinusoidal(torch.arange(len(data)), DIM)
        return self.text_encoder(x[None])  # type: ignore[no-any-return]

    def adapt_hidden(self, hidden: Tensor) -> Tensor:
        return self.adapter(hidden)[None]  # type: ignore[no-any-return]

    def frame_embedding(self, codes: Tensor | None) -> Tensor:
        """[1, DIM] input embedding of a frame's 4 codes (the BOS vector for ``None``)."""
        if codes is None:
            return self.bos.weight
        x: Tensor = self.codebooks[0](codes[0:1])
        for c in range(1, NUM_CODEBOOKS):
            x = x + self.codebooks[c](codes[c : c + 1])
        return x

    def step(
        self,
        x: Tensor,
        caches: list[KVCache],
        memory_kv: list[tuple[Tensor, Tensor]],
    ) -> Tensor:
        """Logits [NUM_CODEBOOKS, CODEBOOK_SIZE] for the next frame given input [1, 1, DIM]."""
        logits: Tensor = self.heads(self.norm(self.blocks(x, caches, memory_kv)[0, -1]))
        return logits.view(NUM_CODEBOOKS, CODEBOOK_SIZE)


@dataclass(frozen=True)
class TalkerInput:
    voice: int
    frames: int
    text: bytes | None
    hidden: np.ndarray | None
    temperature: float
    top_k: int


class TalkerEngine(TorchEngine[TalkerInput]):
    """Codec-frame AR model conditioned on thinker hidden states or text (module docstring)."""

    model: TalkerModel

    def build(self, seed: int) -> int:
        self.max_frames = extra_int(self.ctx, "max_frames", 256, 1, 8192)
        self.max_prompt_bytes = extra_int(
            self.ctx, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, 1, 1 << 16
        )
        self.temperature = extra_float(self.ctx, "temperature", 0.9, 0.0, 10.0)
        self.top_k = extra_int(self.ctx, "top_k", 64, 0, CODEBOOK_SIZE)
        self.chunk_frames = extra_int(self.ctx, "chunk_frames", 10, 1, 1024)
        self.model = TalkerModel().eval()
        init_weights(self.model, seed)
        return sum(p.numel() for p in self.model.parameters())

    def parse(self, request: EngineRequest) -> TalkerInput:
        fields = self.reader(request)
        voice = voice_index(fields)
        if self.is_entry:
            return self._parse_text(request, fields, voice)
        hidden = fields.array("hidden_states", np.float32, (None, THINKER_HIDDEN))
        if hidden.shape[0] > MAX_CONDITION_TOKENS:
            raise fields.error(
                "array", "hidden_states", f"has more than {MAX_CONDITION_TOKENS} rows"
            )
        tokens = fields.optional_int("text_tokens", hidden.shape[0], 1, MAX_CONDITION_TOKENS)
        assert tokens is not None
        frames = min(FRAMES_PER_TOKEN * tokens, self.max_frames)
        return TalkerInput(voice, frames, None, hidden, self.temperature, self.top_k)

    def _parse_text(self, request: EngineRequest, fields: FieldReader, voice: int) -> TalkerInput:
        text = fields.prompt_bytes("prompt", self.max_prompt_bytes)
        sampling = request.sampling
        caps = [self.max_frames, fields.optional_int("max_tokens", None, 1, 8192)]
        if sampling is not None:
            caps.append(sampling.max_tokens)
        frames = min([FRAMES_PER_TOKEN * len(text), *(c for c in caps if c is not None)])
        temperature, top_k = temperature_top_k(sampling, self.temperature, self.top_k)
        return TalkerInput(voice, frames, text, None, temperature, top_k)

    def run(
        self, request: EngineRequest, inputs: TalkerInput, generator: torch.Generator
    ) -> EngineResult:
        (codes,) = self._generate(inputs, generator, inputs.frames)
        output = StageData(
            fields={"num_frames": inputs.frames, "voice": VOICES[inputs.voice]},
            arrays={"codes": codes},
        )
        return EngineResult(request.request_id, output=output)

    def run_chunks(
        self, request: EngineRequest, inputs: TalkerInput, generator: torch.Generator
    ) -> Iterator[EngineResult]:
        """The codes every ``chunk_frames`` frames, with their context (module docstring)."""
        done: list[np.ndarray] = []
        offset = 0
        for codes in self._generate(inputs, generator, self.chunk_frames):
            arrays = {"codes": codes}
            if offset:
                recent = np.concatenate(done[-CONTEXT_FRAMES:])  # >= min(CONTEXT, offset) rows
                arrays["context_codes"] = recent[-min(CONTEXT_FRAMES, offset) :]
            n = len(codes)
            fields: dict[str, Scalar] = {
                "num_frames": n,
                "voice": VOICES[inputs.voice],
                "frame_offset": offset,
            }
            offset += n
            done.append(codes)
            yield EngineResult(
                request.request_id,
                output=StageData(fields=fields, arrays=arrays),
                last=offset == inputs.frames,
            )

    def _generate(
        self, inputs: TalkerInput, generator: torch.Generator, every: int
    ) -> Iterator[np.ndarray]:
        """Sample the request's frames, yielding int64 [n, 4] blocks of ``every`` frames (the
        last may be shorter); the sampling is the same whatever ``every`` is."""
        model = self.model
        if inputs.hidden is not None:
            memory = model.adapt_hidden(as_tensor(inputs.hidden))
        else:
            assert inputs.text is not None
            memory = model.encode_text(inputs.text)
        memory_kv = model.blocks.memory_kv(memory)
        caches = model.blocks.new_caches(inputs.frames)
        speaker = model.speaker.weight[inputs.voice : inputs.voice + 1]
        codes = torch.empty(inputs.frames, NUM_CODEBOOKS, dtype=torch.int64)
        previous: Tensor | None = None
        start = 0
        for frame in range(inputs.frames):
            x = model.frame_embedding(previous) + speaker + sinusoidal(torch.tensor([frame]), DIM)
            logits = model.step(x[None], caches, memory_kv)
            previous = sample(
                logits, temperature=inputs.temperature, top_k=inputs.top_k, generator=generator
            )
            codes[frame] = previous
            if frame + 1 - start == every or frame + 1 == inputs.frames:
                yield codes[start : frame + 1].numpy()
                start = frame + 1
