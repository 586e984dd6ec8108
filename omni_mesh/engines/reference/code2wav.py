"""code2wav (tiny-omni stage 2, tiny-tts stage 1): a causal convolutional codec decoder.

Codes int64 [F, 4] (4 codebooks of 1024) → summed codebook embeddings [F, 256] → two residual
blocks of causal Conv1d (k=3, padded on the left only) at the 12.5 Hz frame rate → four
transposed-convolution upsamplers with kernel == stride (x8, x8, x5, x6 = 1920 samples per
frame; no overlap between frames) with GELU → a causal Conv1d (k=7) to one channel → a fixed
gain and offset, then tanh: a 24 kHz float32 waveform in (-1, 1), length F x 1920. No sampling:
the output depends only on the codes.

Being causal with a fixed gain (computed once at ``load()`` from a fixed calibration code
sequence, instead of normalising each waveform by its own RMS), the decoder's sample ``t``
depends only on the frames up to ``t``'s and the :data:`CONTEXT_FRAMES` before them. So a chunk
decoded after its ``context_codes`` gives, up to float rounding, the samples of the whole
sequence's decode: that is how ``async_chunk`` streams audio.

Input: array ``codes`` int64 [F, 4] and optionally ``context_codes`` int64 [M, 4], the frames
just before ``codes`` (decoded first, their samples dropped). Final: fields ``sample_rate``
(24000), array ``waveform`` float32 [F * 1920]: the audio of ``codes`` only. ``output`` is empty
(nothing runs after this stage).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.extras import extra_int
from omni_mesh.engines.reference.codec import (
    CODEBOOK_SIZE,
    CONTEXT_FRAMES,
    NUM_CODEBOOKS,
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
)
from omni_mesh.engines.reference.common import as_tensor
from omni_mesh.engines.reference.layers import init_weights
from omni_mesh.engines.seeds import derive_seed, make_generator
from omni_mesh.engines.torch_engine import TorchEngine

__all__ = ["CONTEXT_FRAMES", "SAMPLES_PER_FRAME", "SAMPLE_RATE", "Code2WavEngine", "Decoder"]

UPSAMPLE = (8, 8, 5, 6)
CHANNELS = (256, 128, 64, 32, 16)
PRE_BLOCKS = 2
PRE_KERNEL = 3
POST_KERNEL = 7
TARGET_RMS = 0.3
OUTPUT_PEAK = 0.95
CALIBRATION_FRAMES = 256


class CausalConv1d(nn.Conv1d):
    """Conv1d padded on the left only: output ``t`` sees inputs ``t - k + 1 … t``."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class ResidualConv(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = CausalConv1d(channels, channels, PRE_KERNEL)
        self.conv2 = CausalConv1d(channels, channels, PRE_KERNEL)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return x + 0.5 * self.conv2(self.act(self.conv1(self.act(x))))  # type: ignore[no-any-return]


def receptive_field_frames() -> int:
    """Frames of left context one output sample can depend on (what CONTEXT_FRAMES must be)."""
    pre = PRE_BLOCKS * 2 * (PRE_KERNEL - 1)  # frame-rate convs
    post = -(-(POST_KERNEL - 1) // SAMPLES_PER_FRAME)  # sample-rate history, in frames (ceil)
    return pre + post


class Decoder(nn.Module):
    """Codes [F, 4] → raw (un-normalised) waveform [F * 1920]; strictly causal."""

    def __init__(self) -> None:
        super().__init__()
        width = CHANNELS[0]
        self.codebooks = nn.ModuleList(
            nn.Embedding(CODEBOOK_SIZE, width) for _ in range(NUM_CODEBOOKS)
        )
        self.pre = nn.Sequential(*(ResidualConv(width) for _ in range(PRE_BLOCKS)))
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(c_in, c_out, s, stride=s)
            for c_in, c_out, s in zip(CHANNELS[:-1], CHANNELS[1:], UPSAMPLE, strict=True)
        )
        self.act = nn.GELU()
        self.post = CausalConv1d(CHANNELS[-1], 1, POST_KERNEL)

    def forward(self, codes: Tensor) -> Tensor:
        x = self.codebooks[0](codes[:, 0])
        for c in range(1, NUM_CODEBOOKS):
            x = x + self.codebooks[c](codes[:, c])
        x = self.pre(x.T[None])
        for up in self.ups:
            x = self.act(up(x))
        return self.post(x)[0, 0]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Code2WavInput:
    codes: np.ndarray
    context: np.ndarray | None


class Code2WavEngine(TorchEngine[Code2WavInput]):
    """Codec decoder: codes → 24 kHz waveform (see module docstring)."""

    model: Decoder
    offset: float
    gain: float

    def build(self, seed: int) -> int:
        self.max_frames = extra_int(self.ctx, "max_frames", 4096, 1, 1 << 16)
        self.model = Decoder().eval()
        init_weights(self.model, seed)
        self.offset, self.gain = self._calibrate(seed)
        return sum(p.numel() for p in self.model.parameters())

    def _calibrate(self, seed: int) -> tuple[float, float]:
        """Offset and gain that bring the raw decode of a fixed random code sequence to zero
        mean and ``TARGET_RMS``: one pointwise map for every chunk of every request."""
        gen = make_generator(derive_seed("code2wav-calibration", seed))
        codes = torch.randint(0, CODEBOOK_SIZE, (CALIBRATION_FRAMES, NUM_CODEBOOKS), generator=gen)
        raw = self.model(codes).to(torch.float64)
        offset = float(raw.mean())
        return offset, TARGET_RMS / (float((raw - offset).pow(2).mean().sqrt()) + 1e-6)

    def parse(self, request: EngineRequest) -> Code2WavInput:
        fields = self.reader(request)
        codes = fields.int_array("codes", (None, NUM_CODEBOOKS), CODEBOOK_SIZE, self.max_frames)
        context = None
        if "context_codes" in request.data.arrays:
            context = fields.int_array(
                "context_codes", (None, NUM_CODEBOOKS), CODEBOOK_SIZE, self.max_frames
            )
        return Code2WavInput(codes, context)

    def decode(self, codes: np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
        """The waveform of ``codes`` [F, 4] (float32 [F * 1920]), decoded after ``context``."""
        skip = 0
        if context is not None and len(context):
            skip = len(context) * SAMPLES_PER_FRAME
            codes = np.concatenate([context, codes])
        with torch.inference_mode():
            raw = self.model(as_tensor(codes))[skip:]
            wave = torch.tanh((raw - self.offset) * self.gain) * OUTPUT_PEAK
        return wave.numpy()

    def run(
        self, request: EngineRequest, inputs: Code2WavInput, generator: torch.Generator
    ) -> EngineResult:
        wave = self.decode(inputs.codes, inputs.context)
        final = StageData(fields={"sample_rate": SAMPLE_RATE}, arrays={"waveform": wave})
        return EngineResult(request.request_id, final=final)
