"""csm-tts stage 1, code2wav: the decoder of CSM's Mimi codec, on transformers.

The stage loads the checkpoint's ``codec_model.*`` tensors as a ``MimiModel``. A whole utterance
is decoded as the monolithic ``CsmForConditionalGeneration.generate(..., output_audio=True)``
decodes it: ``codec_model.decode(codes [1, G, F]).audio_values[0, 0]``.

A chunk of a stream (``codes`` with the ``context_codes`` before it) is decoded after its
context, and the context's samples are dropped. Which samples of a decode are final is measured
when the stage loads, on the decoder itself: a decode of n frames yields ``n * hop - drop``
samples, the last ``tail`` of which change once later frames exist (they would need the next
frame). Mimi's transposed convolutions are trimmed on the right, so for Mimi both are 0 (every
sample is final as soon as its frame is decoded; tiny-csm: hop 1920, drop 0, tail 0); the
general rule still holds for a decoder that has a tail: a chunk keeps its samples from
``context * hop - drop - tail`` (the previous chunk's unfinished tail, now finished) and, unless
it is the stream's last chunk (the request's ``last``), holds back its own last ``tail``. The
chunks' samples concatenated are the whole decode's up to float rounding when the context
covers the decoder's left receptive field. Measured on tiny-csm (a code changed, the samples of
later frames compared): a code moves its own and the next 5 frames' samples by up to 0.5 (the
causal convolutions), the next 4 by < 2e-3 (the decoder transformer's 8-step sliding window over
its 2 layers), the 10th after it by 1e-6 and nothing from the 13th on; a stream decoded with 10
frames of context is within 5e-7 of the whole decode, with 12 within 3.5e-7 (the talker sends
25). A stream's first frames have their whole history as context. The real Mimi attends 250
steps (10 s) back in each of 8 layers: a real checkpoint needs ``context_frames`` of 125 at the
very least (its stacked layers reach further still) for float-level equality; a shorter context
gives audio that is close to the whole decode's, not equal to it.

Several requests in one batch are decoded one by one (their lengths differ; the monolithic
model decodes one utterance at a time too).

Input: array ``codes`` int64 [F, G] (F may be 0 on a stream's last chunk), optionally
``context_codes`` int64 [M, G]. Final: field ``sample_rate`` (the codec's, 24000), array
``waveform`` float32 [S].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.csm.talker import DEFAULT_MODEL
from omni_mesh.engines.fields import FieldReader
from omni_mesh.engines.hf.codes import codes_array
from omni_mesh.engines.hf.common import load_part, model_folder, parameter_count
from omni_mesh.engines.torch_engine import TorchEngine

MAX_FRAMES = 1 << 16
#: A sample counts as unfinished when a later frame moves it by more than this (relative to
#: the probe's peak): float rounding between two decode lengths is ~1e-7 of it.
UNFINISHED = 1e-4


@dataclass
class Code2WavInput:
    codes: np.ndarray  # [F, G]
    context: np.ndarray | None  # [M, G]
    last: bool  # the stream's last chunk (or a whole input): no tail held back


class CsmCode2WavEngine(TorchEngine[Code2WavInput]):
    """CSM's Mimi decoder (module docstring)."""

    model: Any

    def build(self, seed: int) -> int:
        from transformers import CsmConfig, MimiModel

        folder = model_folder(self.ctx, DEFAULT_MODEL)
        config = CsmConfig.from_pretrained(str(folder)).codec_config
        self.groups = int(config.num_quantizers)
        self.codebook = int(config.codebook_size)
        self.sample_rate = int(config.sampling_rate)
        self.model = load_part(MimiModel, folder, config, "codec_model", self.ctx)
        self.device = next(self.model.parameters()).device
        self.hop, self.drop, self.tail = self._measure()
        return parameter_count(self.model)

    def _measure(self) -> tuple[int, int, int]:
        """(hop, drop, tail) of the decoder (module docstring), from decodes of 4 and 8 frames."""
        probe = torch.arange(8 * self.groups).reshape(self.groups, 8) * 7 % self.codebook
        with torch.inference_mode():
            short = self._decode(probe[:, :4])
            long = self._decode(probe)
        hop = (len(long) - len(short)) // 4
        drop = 4 * hop - len(short)
        moved = (long[: len(short)] - short).abs() > UNFINISHED * float(long.abs().max())
        unfinished = torch.nonzero(moved).flatten()
        tail = len(short) - int(unfinished[0]) if len(unfinished) else 0
        if tail > 3 * hop:
            raise RuntimeError(
                f"{self.where}: the decoder's unfinished tail ({tail}) is > 3 frames"
            )
        return hop, drop, tail

    def _decode(self, frames: torch.Tensor) -> torch.Tensor:
        audio = self.model.decode(frames[None].to(self.device)).audio_values[0, 0]
        return audio.cpu()  # type: ignore[no-any-return]

    def parse(self, request: EngineRequest) -> Code2WavInput:
        fields = self.reader(request)
        codes = self._codes(fields, "codes", required=True)
        assert codes is not None
        context = self._codes(fields, "context_codes", required=False)
        if context is not None and len(context) * self.hop < self.drop + self.tail:
            raise fields.error("array", "context_codes", "is too short for the decoder")
        return Code2WavInput(codes, context, request.last)

    def _codes(self, fields: FieldReader, name: str, *, required: bool) -> np.ndarray | None:
        return codes_array(fields, name, self.groups, self.codebook, MAX_FRAMES, required=required)

    def run(
        self, request: EngineRequest, inputs: Code2WavInput, generator: torch.Generator
    ) -> EngineResult:
        wave = self.decode(inputs.codes, inputs.context, last=inputs.last)
        final = StageData(fields={"sample_rate": self.sample_rate}, arrays={"waveform": wave})
        return EngineResult(request.request_id, final=final)

    def decode(self, codes: np.ndarray, context: np.ndarray | None, *, last: bool) -> np.ndarray:
        """The final samples of ``codes`` after ``context`` (module docstring), float32."""
        m = 0 if context is None else len(context)
        if len(codes) == 0 and (m == 0 or self.tail == 0):
            return np.zeros(0, np.float32)
        frames = codes if context is None else np.concatenate([context, codes])
        wave = self._decode(torch.from_numpy(np.ascontiguousarray(frames.T)))
        start = m * self.hop - self.drop - self.tail if m else 0
        end = len(wave) if last else len(wave) - self.tail
        return wave[start:end].to(torch.float32).contiguous().numpy()
