"""qwen3-omni stage 2, code2wav: Qwen3-Omni-MoE's causal Code2Wav decoder on transformers.

A whole utterance is decoded as the monolithic model decodes it:
``code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25)``.

A chunk of a stream (``codes`` with the ``context_codes`` before it) is decoded after its
context, and the context's samples are dropped, but not all of them: the decoder's transposed
convolutions leave the last ``tail`` samples of any decode unfinished (they need the next frame),
so a decode of n frames yields ``n * upsample - tail`` samples. A chunk with context therefore
keeps its samples from ``context * upsample - tail``: the previous chunk's unfinished tail, now
finished, then its own. The chunks' samples concatenated are the whole decode's up to float
rounding when the context covers the decoder's reach (the tiny decoder: one layer, window 8)
and the utterance fits one of ``chunked_decode``'s 300-frame chunks (beyond that the monolithic
decode itself drops a tail at each boundary). The real decoder's attention reaches further back
(8 layers x window 72) than its convolutions (~10 frames): there 25 frames of context is the
same approximation ``chunked_decode`` makes at its own boundaries (a random real-shape decoder,
chunks of 10: max difference 2.6e-6 against the whole decode).

The requests of one batch are decoded together, in one forward over their frames right-padded
to the longest (the decoder is causal: padding after a row's frames changes none of its
samples, and each row is cut at its own length, as the monolithic ``generate`` decodes a
batch); a row longer than one ``chunked_decode`` chunk (300 frames) without context is decoded
alone, as the monolith decodes it.

Input: array ``codes`` int64 [F, G] (F may be 0 on a stream's last chunk), optionally
``context_codes`` int64 [M, G]. Final: field ``sample_rate`` (24000), array ``waveform``
float32 [S].
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_mesh.engines.base import EngineInputError, EngineRequest, EngineResult, StageData
from omni_mesh.engines.fields import FieldReader
from omni_mesh.engines.hf.codes import codes_array
from omni_mesh.engines.hf.common import load_part, model_folder, parameter_count
from omni_mesh.engines.qwen3_omni.thinker import DEFAULT_MODEL
from omni_mesh.engines.torch_engine import TorchEngine

SAMPLE_RATE = 24000
CHUNK_SIZE = 300
LEFT_CONTEXT = 25
MAX_FRAMES = 1 << 16


@dataclass
class Code2WavInput:
    codes: np.ndarray  # [F, G]
    context: np.ndarray | None  # [M, G]


class Qwen3OmniCode2WavEngine(TorchEngine[Code2WavInput]):
    """Qwen3-Omni's Code2Wav (module docstring)."""

    model: Any

    def build(self, seed: int) -> int:
        from transformers import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeCode2Wav,
        )

        folder = model_folder(self.ctx, DEFAULT_MODEL)
        config = Qwen3OmniMoeConfig.from_pretrained(str(folder)).code2wav_config
        self.groups = int(config.num_quantizers)
        self.codebook = int(config.codebook_size)
        self.model = load_part(Qwen3OmniMoeCode2Wav, folder, config, "code2wav", self.ctx)
        self.device = next(self.model.parameters()).device
        self.upsample = int(self.model.total_upsample)
        with torch.inference_mode():
            probe = self.model(self._tensor(np.zeros((1, self.groups, 2), np.int64)))
        self.tail = 2 * self.upsample - int(probe.shape[-1])
        return parameter_count(self.model)

    def parse(self, request: EngineRequest) -> Code2WavInput:
        fields = self.reader(request)
        codes = self._codes(fields, "codes", required=True)
        assert codes is not None
        return Code2WavInput(codes, self._codes(fields, "context_codes", required=False))

    def _codes(self, fields: FieldReader, name: str, *, required: bool) -> np.ndarray | None:
        return codes_array(fields, name, self.groups, self.codebook, MAX_FRAMES, required=required)

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        return self._decode_batch(batch)

    def open(self, batch: Sequence[EngineRequest]) -> list[Iterator[EngineResult | None]]:
        return [iter([result]) for result in self._decode_batch(batch)]

    def _decode_batch(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        """Every request's result, in the batch's order; the valid ones decoded together."""
        if not self._loaded:
            raise RuntimeError(f"{self.where}: execute() called before load()")
        results: list[EngineResult | None] = [None] * len(batch)
        rows: list[tuple[int, np.ndarray, int]] = []  # batch index, frames [T, G], keep from
        for i, request in enumerate(batch):
            try:
                inputs = self.parse(request)
            except EngineInputError as exc:
                results[i] = EngineResult(request.request_id, error=str(exc))
                continue
            context = inputs.context if inputs.context is not None else inputs.codes[:0]
            if len(inputs.codes) == 0 or (len(context) == 0 and len(inputs.codes) > CHUNK_SIZE):
                results[i] = self._final(request, self.decode(inputs.codes, inputs.context))
                continue
            if len(context) and len(context) * self.upsample < self.tail:
                message = f"{self.where}: context_codes too short for the decoder"
                results[i] = EngineResult(request.request_id, error=message)
                continue
            start = len(context) * self.upsample - self.tail if len(context) else 0
            rows.append((i, np.concatenate([context, inputs.codes]), start))
        if rows:
            with torch.inference_mode():
                waves = self._forward([frames for _, frames, _ in rows])
            for (i, frames, start), wave in zip(rows, waves, strict=True):
                end = len(frames) * self.upsample - self.tail
                results[i] = self._final(batch[i], _f32(wave[..., start:end]))
        return [r for r in results if r is not None]

    def _forward(self, rows: list[np.ndarray]) -> torch.Tensor:
        """One decoder forward over ``rows`` (frames [T, G] each), right-padded with code 0."""
        longest = max(len(r) for r in rows)
        codes = np.zeros((len(rows), self.groups, longest), np.int64)
        for b, frames in enumerate(rows):
            codes[b, :, : len(frames)] = frames.T
        return self.model(self._tensor(codes))  # type: ignore[no-any-return]

    def _tensor(self, codes: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(codes).to(self.device)

    def _final(self, request: EngineRequest, wave: np.ndarray) -> EngineResult:
        final = StageData(fields={"sample_rate": SAMPLE_RATE}, arrays={"waveform": wave})
        return EngineResult(request.request_id, final=final)

    def run(
        self, request: EngineRequest, inputs: Code2WavInput, generator: torch.Generator
    ) -> EngineResult:
        wave = self.decode(inputs.codes, inputs.context)
        final = StageData(fields={"sample_rate": SAMPLE_RATE}, arrays={"waveform": wave})
        return EngineResult(request.request_id, final=final)

    def decode(self, codes: np.ndarray, context: np.ndarray | None) -> np.ndarray:
        """The samples of ``codes`` (module docstring), float32."""
        if len(codes) == 0:
            return np.zeros(0, np.float32)
        if context is None or len(context) == 0:
            frames = self._tensor(np.array(codes.T))[None]
            wave = self.model.chunked_decode(
                frames, chunk_size=CHUNK_SIZE, left_context_size=LEFT_CONTEXT
            )
            return _f32(wave)
        if len(context) * self.upsample < self.tail:
            raise EngineInputError(f"{self.where}: context_codes too short for the decoder")
        frames = self._tensor(np.concatenate([context, codes]).T.copy())[None]
        wave = self.model(frames)
        return _f32(wave[..., len(context) * self.upsample - self.tail :])


def _f32(wave: torch.Tensor) -> np.ndarray:
    return wave.reshape(-1).to("cpu", torch.float32).contiguous().numpy()
