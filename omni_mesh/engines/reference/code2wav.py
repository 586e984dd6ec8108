"""code2wav (tiny-omni stage 2, tiny-tts stage 1): a convolutional codec decoder.

Codes int64 [F, 4] (4 codebooks of 1024) → summed codebook embeddings [F, 256] → two residual
Conv1d blocks at the 12.5 Hz frame rate → four transposed-convolution upsamplers (x8, x8, x5, x6 =
1920 samples per frame) with GELU → Conv1d to one channel → RMS normalisation and tanh: a 24 kHz
float32 waveform in (-1, 1), length F x 1920. No sampling: the output depends only on the codes.

Input: array ``codes`` int64 [F, 4]. Final: fields ``sample_rate`` (24000), array ``waveform``
float32 [F * 1920]. ``output`` is empty (nothing runs after this stage).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.reference.common import ReferenceEngine, as_tensor, extra_int
from omni_mesh.engines.reference.layers import init_weights
from omni_mesh.engines.reference.talker import CODEBOOK_SIZE, NUM_CODEBOOKS

SAMPLE_RATE = 24_000
UPSAMPLE = (8, 8, 5, 6)
SAMPLES_PER_FRAME = 1920
CHANNELS = (256, 128, 64, 32, 16)
TARGET_RMS = 0.3
OUTPUT_PEAK = 0.95


class ResidualConv(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, padding=1)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return x + 0.5 * self.conv2(self.act(self.conv1(self.act(x))))  # type: ignore[no-any-return]


def _upsampler(c_in: int, c_out: int, stride: int) -> nn.ConvTranspose1d:
    # output length = (L - 1) * s - 2p + k = L * s when k = s + 2p
    pad = stride // 2
    return nn.ConvTranspose1d(c_in, c_out, stride + 2 * pad, stride=stride, padding=pad)


class Decoder(nn.Module):
    """Codes [F, 4] → waveform [F * 1920]."""

    def __init__(self) -> None:
        super().__init__()
        width = CHANNELS[0]
        self.codebooks = nn.ModuleList(
            nn.Embedding(CODEBOOK_SIZE, width) for _ in range(NUM_CODEBOOKS)
        )
        self.pre = nn.Sequential(ResidualConv(width), ResidualConv(width))
        self.ups = nn.ModuleList(
            _upsampler(c_in, c_out, s)
            for c_in, c_out, s in zip(CHANNELS[:-1], CHANNELS[1:], UPSAMPLE, strict=True)
        )
        self.act = nn.GELU()
        self.post = nn.Conv1d(CHANNELS[-1], 1, 7, padding=3)

    def forward(self, codes: Tensor) -> Tensor:
        x = self.codebooks[0](codes[:, 0])
        for c in range(1, NUM_CODEBOOKS):
            x = x + self.codebooks[c](codes[:, c])
        x = self.pre(x.T[None])
        for up in self.ups:
            x = self.act(up(x))
        wave = self.post(x)[0, 0]
        wave = wave - wave.mean()
        wave = wave * (TARGET_RMS / (wave.pow(2).mean().sqrt() + 1e-6))
        return torch.tanh(wave) * OUTPUT_PEAK


@dataclass(frozen=True)
class Code2WavInput:
    codes: np.ndarray


class Code2WavEngine(ReferenceEngine[Code2WavInput]):
    """Codec decoder: codes → 24 kHz waveform (see module docstring)."""

    model: Decoder

    def build(self, seed: int) -> int:
        self.max_frames = extra_int(self.ctx, "max_frames", 4096, 1, 1 << 16)
        self.model = Decoder().eval()
        init_weights(self.model, seed)
        return sum(p.numel() for p in self.model.parameters())

    def parse(self, request: EngineRequest) -> Code2WavInput:
        fields = self.reader(request)
        codes = fields.int_array("codes", (None, NUM_CODEBOOKS), CODEBOOK_SIZE, self.max_frames)
        return Code2WavInput(codes)

    def run(
        self, request: EngineRequest, inputs: Code2WavInput, generator: torch.Generator
    ) -> EngineResult:
        wave = self.model(as_tensor(inputs.codes)).numpy()
        final = StageData(fields={"sample_rate": SAMPLE_RATE}, arrays={"waveform": wave})
        return EngineResult(request.request_id, final=final)
