"""qwen3-omni stage 1, the talker: Qwen3-Omni-MoE's talker with its code predictor, on
transformers.

Each step the MoE talker picks codebook 0 of a frame and its code predictor the other
``num_code_groups - 1`` codebooks, as ``Qwen3OmniMoeTalkerForConditionalGeneration.generate``
does when the monolithic model calls it (suppressed codec specials, ``codec_eos`` as EOS,
repetition penalty), on the prompt ``talker_prompt`` builds from the thinker's
output. Sampling (``engine_extras``): ``do_sample`` (true), ``temperature`` (0.9), ``top_k``
(50), ``top_p`` (1.0), ``repetition_penalty`` (1.05), the monolithic defaults; each request
samples from its own generator seeded by its seed (as ``torch.manual_seed(seed)`` before the
monolithic ``generate``). ``max_frames`` (default 256) caps a request's frames (the monolithic
``talker_max_new_tokens``).

Continuous batching: every running request of the engine is a row of one
:class:`TalkerBatch` (``talker_batch``), whose step makes one frame for all of them
with one batched forward of the talker and one batched run of the code predictor; the engine
runs that step in ``before_step``, once per core step, and requests opened since the last step
prefill (alone) and join it. A request leaves when it ends or its stream is closed (an abort).
Its codes equal what it gets alone, and what the monolithic ``generate`` gives for its seed.

Streaming (``async_chunk``, whole input): a stream yields ``None`` until it has its first
``engine_extras.first_chunk_frames`` frames (default 2: the first audio comes early) and then
every ``chunk_frames`` frames (default 10): the new frames' ``codes`` with the
``context_codes`` (up to ``context_frames``, default 25: Code2Wav's left context) before them.
Not streaming, a request still runs in the batch and yields one whole result when it ends.

Streamed input (the stage's spec has ``stream_input``; under ``async_chunk`` the thinker hands
its positions on in chunks as it makes them): the request opens on the first chunk (the prompt
and the first answer tokens), prefills, and takes each later text entry when its frame needs it
(``talker_text``); a row ahead of the thinker waits, parked, while the others decode. Its codes
are those of the whole-answer hand-off.

Output: array ``codes`` int64 [F, G] (frame-major), fields ``num_frames``, ``frame_offset``;
``context_codes`` int64 [M, G] on every chunk but the first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_mesh.engines.base import EngineRequest, EngineResult
from omni_mesh.engines.batching.frame_engine import FrameEngine
from omni_mesh.engines.batching.row_sampling import Sampling, row_generator
from omni_mesh.engines.extras import extra_bool, extra_float, extra_int
from omni_mesh.engines.hf.codes import codes_chunk
from omni_mesh.engines.hf.common import load_part, model_folder, parameter_count
from omni_mesh.engines.qwen3_omni.speakers import speaker_name
from omni_mesh.engines.qwen3_omni.talker_batch import TalkerBatch, TalkerRow
from omni_mesh.engines.qwen3_omni.talker_prompt import TalkerPrompt, talker_prompt
from omni_mesh.engines.qwen3_omni.talker_text import StreamedText
from omni_mesh.engines.qwen3_omni.thinker import DEFAULT_MODEL

MAX_POSITIONS = 1 << 16


@dataclass
class TalkerInput:
    sequences: np.ndarray
    prompt_tokens: int
    embed: np.ndarray
    hidden: np.ndarray
    special: np.ndarray
    speaker_id: int
    audio_lengths: np.ndarray | None


class Qwen3OmniTalkerEngine(FrameEngine[TalkerInput]):
    """Qwen3-Omni's talker + code predictor (module docstring)."""

    step_audio_s = 0.08  # one codec frame per row and step: 12.5 Hz

    model: Any

    def build(self, seed: int) -> int:
        from transformers import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerForConditionalGeneration,
        )

        ctx = self.ctx
        self.max_frames = extra_int(ctx, "max_frames", 256, 1, 1 << 15)
        self.chunk_frames = extra_int(ctx, "chunk_frames", 10, 1, 4096)
        self.first_chunk_frames = extra_int(ctx, "first_chunk_frames", 2, 1, 4096)
        self.context_frames = extra_int(ctx, "context_frames", 25, 1, 4096)
        do_sample = extra_bool(ctx, "do_sample", True)
        knobs: dict[str, Any] = {
            "repetition_penalty": extra_float(ctx, "repetition_penalty", 1.05, 0.01, 10.0)
        }
        if do_sample:
            knobs.update(
                temperature=extra_float(ctx, "temperature", 0.9, 0.01, 10.0),
                top_k=extra_int(ctx, "top_k", 50, 0, 1 << 20),
                top_p=extra_float(ctx, "top_p", 1.0, 0.01, 1.0),
            )
        folder = model_folder(ctx, DEFAULT_MODEL)
        self.config = Qwen3OmniMoeConfig.from_pretrained(str(folder))
        self.model = load_part(
            Qwen3OmniMoeTalkerForConditionalGeneration,
            folder,
            self.config.talker_config,
            "talker",
            self.ctx,
        )
        tc = self.config.talker_config
        vocab = tc.text_config.vocab_size
        suppressed = tuple(i for i in range(vocab - 1024, vocab) if i != tc.codec_eos_token_id)
        sampling = Sampling(do_sample, suppress=suppressed, **knobs)
        self.batch = TalkerBatch(self.model, sampling, self.max_frames)
        return parameter_count(self.model)

    def parse(self, request: EngineRequest) -> TalkerInput:
        fields = self.reader(request)
        d = self.config.thinker_config.text_config.hidden_size
        sequences = fields.array("sequences", np.int64, (None,))
        prompt = fields.optional_int("prompt_tokens", None, 2, MAX_POSITIONS)
        if prompt is None or prompt >= len(sequences):
            raise fields.error("field", "prompt_tokens", "must be set, below len(sequences)")
        head = sequences[:prompt]
        if not np.any(
            (head[:-1] == self.config.im_start_token_id)
            & (head[1:] == self.config.assistant_token_id)
        ):
            raise fields.error("array", "sequences", "has no assistant turn in its prompt")
        embed = fields.array("thinker_embed", np.float32, (len(sequences) - 1, d))
        hidden = fields.array("thinker_hidden", np.float32, (len(sequences) - 1, d))
        special = fields.array("tts_special", np.float32, (3, d))
        lengths = None
        if "audio_feature_lengths" in fields.data.arrays:
            lengths = fields.array("audio_feature_lengths", np.int64, (None,))
        speakers = self.config.talker_config.speaker_id
        voice = speaker_name(fields, speakers)
        return TalkerInput(sequences, prompt, embed, hidden, special, speakers[voice], lengths)

    def row(self, request: EngineRequest, inputs: TalkerInput) -> TalkerRow | EngineResult:
        if request.last and _too_short(inputs):
            return self.chunk(request, [], 0, last=True)
        row = TalkerRow(
            request.request_id,
            row_generator(request.seed, self.model.device),
            build=functools.partial(self._prompt, inputs),
        )
        if not request.last:  # a streamed answer: the thinker's later positions are to come
            row.text = StreamedText(
                self.model,
                request,
                inputs.prompt_tokens,
                int(self.config.im_end_token_id),
                functools.partial(self._whole_text, request),
            )
        return row

    def chunk(
        self, request: EngineRequest, frames: list[np.ndarray], sent: int, last: bool
    ) -> EngineResult:
        groups = self.config.talker_config.num_code_groups
        return codes_chunk(request.request_id, frames, sent, groups, self.context_frames, last=last)

    def _prompt(self, inputs: TalkerInput) -> TalkerPrompt:
        lengths = inputs.audio_lengths
        return talker_prompt(
            self.model,
            self.config,
            torch.from_numpy(np.array(inputs.sequences)),
            inputs.prompt_tokens,
            torch.from_numpy(np.array(inputs.embed)),
            torch.from_numpy(np.array(inputs.hidden)),
            torch.from_numpy(np.array(inputs.special)),
            inputs.speaker_id,
            None if lengths is None else torch.from_numpy(np.array(lengths)),
        )

    def _whole_text(self, request: EngineRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """A streamed answer's trailing text and tts_pad once all of it is in, as the whole
        hand-off's prompt has them (an answer too short to speak: no text, only tts_pad)."""
        inputs = self.parse(request)
        prompt = self._prompt(inputs)
        trailing = prompt.trailing_text_hidden
        if _too_short(inputs):
            trailing = trailing[:, :0]
        return trailing, prompt.tts_pad_embed


def _too_short(inputs: TalkerInput) -> bool:
    """An answer of fewer than 2 tokens (``max_tokens`` 1, or an immediate ``<|im_end|>``) has
    no first text token for the assistant part: it is spoken as no audio (the monolithic
    ``generate`` fails on it)."""
    return len(inputs.sequences) - inputs.prompt_tokens < 2
