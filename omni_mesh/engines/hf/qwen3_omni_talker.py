"""qwen3-omni stage 1, the talker: Qwen3-Omni-MoE's talker with its code predictor, on
transformers.

Each step the MoE talker picks codebook 0 of a frame and its code predictor the other
``num_code_groups - 1`` codebooks, all inside ``Qwen3OmniMoeTalkerForConditionalGeneration
.generate``, called as the monolithic model calls it (suppressed codec specials, ``codec_eos``
as EOS, repetition penalty) on the prompt ``qwen3_omni_talker_prompt`` builds from the thinker's
output. Sampling (``engine_extras``): ``do_sample`` (true), ``temperature`` (0.9), ``top_k``
(50), ``top_p`` (1.0), ``repetition_penalty`` (1.05), the monolithic defaults; each request
samples from its own RNG stream seeded by its seed (``common.seeded_rng``). ``max_frames``
(default 256) caps a request's frames (the monolithic ``talker_max_new_tokens``).

Streaming (``async_chunk``, whole input): the generation runs in a :class:`SteppedCall` and
yields its first ``engine_extras.first_chunk_frames`` frames (default 2: the first audio comes
early) and then every ``chunk_frames`` frames (default 10) the new frames' ``codes`` with
the ``context_codes`` (up to ``context_frames``, default 25: Code2Wav's left context) before
them. Streams of several requests take turns step by step, each with its own KV cache; the
process-wide state a generation uses (RNG, the talker's ``rope_deltas``) is swapped per request
around each turn, so a request's codes do not depend on what else runs.

Output: array ``codes`` int64 [F, G] (frame-major), fields ``num_frames``, ``frame_offset``;
``context_codes`` int64 [M, G] on every chunk but the first.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import EngineConfigError, EngineRequest, EngineResult, StageData
from omni_mesh.engines.hf.codes import codes_chunk
from omni_mesh.engines.hf.common import load_part, model_folder, parameter_count, seeded_rng
from omni_mesh.engines.hf.qwen3_omni_talker_prompt import TalkerPrompt, talker_prompt
from omni_mesh.engines.hf.qwen3_omni_thinker import DEFAULT_MODEL
from omni_mesh.engines.hf.speakers import speaker_name
from omni_mesh.engines.hf.stepped import (
    CheckpointStreamer,
    SteppedCall,
    TurnState,
    has_at_least,
    take_turn,
)
from omni_mesh.engines.reference.common import ReferenceEngine, extra_float, extra_int

MAX_POSITIONS = 1 << 16
#: transformers warns that the repetition penalty sees only generated codes (the prompt is
#: embeddings): that is how the monolithic model runs its talker too.
REPETITION_WARNING = "Passing `repetition_penalty` with `inputs_embeds`"


@dataclass
class TalkerInput:
    sequences: np.ndarray
    prompt_tokens: int
    embed: np.ndarray
    hidden: np.ndarray
    special: np.ndarray
    speaker_id: int
    audio_lengths: np.ndarray | None


class Qwen3OmniTalkerEngine(ReferenceEngine[TalkerInput]):
    """Qwen3-Omni's talker + code predictor (module docstring)."""

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
        do_sample = ctx.config.engine_extras.get("do_sample", True)
        if not isinstance(do_sample, bool):
            raise EngineConfigError(
                f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.do_sample must "
                f"be true or false, got {do_sample!r}"
            )
        self.sampling: dict[str, Any] = {"do_sample": do_sample}
        if do_sample:
            self.sampling.update(
                temperature=extra_float(ctx, "temperature", 0.9, 0.01, 10.0),
                top_k=extra_int(ctx, "top_k", 50, 0, 1 << 20),
                top_p=extra_float(ctx, "top_p", 1.0, 0.01, 1.0),
            )
        self.repetition_penalty = extra_float(ctx, "repetition_penalty", 1.05, 0.01, 10.0)
        folder = model_folder(ctx, DEFAULT_MODEL)
        self.config = Qwen3OmniMoeConfig.from_pretrained(str(folder))
        self.model = load_part(
            Qwen3OmniMoeTalkerForConditionalGeneration, folder, self.config.talker_config, "talker"
        )
        tc = self.config.talker_config
        vocab = tc.text_config.vocab_size
        self.suppressed = [i for i in range(vocab - 1024, vocab) if i != tc.codec_eos_token_id]
        self._capture: list[np.ndarray] | None = None
        self.model.register_forward_hook(self._on_forward)
        return parameter_count(self.model)

    def _on_forward(self, module: Any, args: Any, output: Any) -> None:
        codes = output.hidden_states[1]  # the frame the code predictor completed this step
        if codes is not None and self._capture is not None:
            self._capture.append(codes[0].numpy().astype(np.int64))

    def parse(self, request: EngineRequest) -> TalkerInput:
        fields = self.reader(request)
        d = self.config.thinker_config.text_config.hidden_size
        sequences = fields.array("sequences", np.int64, (None,))
        prompt = fields.optional_int("prompt_tokens", None, 2, MAX_POSITIONS)
        if prompt is None or prompt >= len(sequences):
            raise fields.error("field", "prompt_tokens", "must be set, below len(sequences)")
        embed = fields.array("thinker_embed", np.float32, (len(sequences) - 1, d))
        hidden = fields.array("thinker_hidden", np.float32, (len(sequences) - 1, d))
        special = fields.array("tts_special", np.float32, (3, d))
        lengths = None
        if "audio_feature_lengths" in fields.data.arrays:
            lengths = fields.array("audio_feature_lengths", np.int64, (None,))
        speakers = self.config.talker_config.speaker_id
        voice = speaker_name(fields, speakers)
        return TalkerInput(sequences, prompt, embed, hidden, special, speakers[voice], lengths)

    def _chunk(
        self, request: EngineRequest, frames: list[np.ndarray], sent: int, *, last: bool
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

    def _generate(self, prompt: TalkerPrompt, **extra: Any) -> Any:
        kwargs: dict[str, Any] = {}
        if prompt.audio_feature_lengths is not None:
            kwargs["audio_feature_lengths"] = prompt.audio_feature_lengths
        with warnings.catch_warnings():  # as the monolithic generate: the prompt is embeddings
            warnings.filterwarnings("ignore", message=REPETITION_WARNING, category=UserWarning)
            return self._call_generate(prompt, kwargs, extra)

    def _call_generate(
        self, prompt: TalkerPrompt, kwargs: dict[str, Any], extra: dict[str, Any]
    ) -> Any:
        return self.model.generate(
            inputs_embeds=prompt.inputs_embeds,
            trailing_text_hidden=prompt.trailing_text_hidden,
            tts_pad_embed=prompt.tts_pad_embed,
            talker_input_ids=prompt.talker_input_ids,
            attention_mask=torch.ones(prompt.talker_input_ids.shape, dtype=torch.long),
            max_new_tokens=self.max_frames,
            eos_token_id=self.config.talker_config.codec_eos_token_id,
            repetition_penalty=self.repetition_penalty,
            suppress_tokens=self.suppressed,
            output_hidden_states=True,
            return_dict_in_generate=True,
            **self.sampling,
            **kwargs,
            **extra,
        )

    def run(
        self, request: EngineRequest, inputs: TalkerInput, generator: torch.Generator
    ) -> EngineResult:
        if _too_short(inputs):
            return self._chunk(request, [], 0, last=True)
        with seeded_rng(request.seed):
            result = self._generate(self._prompt(inputs))
        frames = [h[-1] for h in result.hidden_states if h[-1] is not None]
        g = self.config.talker_config.num_code_groups
        codes = torch.cat(frames).numpy().astype(np.int64) if frames else np.zeros((0, g))
        fields: dict[str, Scalar] = {"num_frames": len(codes), "frame_offset": 0}
        return EngineResult(
            request.request_id, StageData(fields=fields, arrays={"codes": codes.astype(np.int64)})
        )

    def run_chunks(
        self, request: EngineRequest, inputs: TalkerInput, generator: torch.Generator
    ) -> Iterator[EngineResult | None]:
        """One frame per step (``None`` until a chunk is full), so requests interleave frame
        by frame and an abort waits for one frame, not for a whole chunk."""
        if _too_short(inputs):
            yield self._chunk(request, [], 0, last=True)
            return
        state = TurnState.start(request.seed, ("rope_deltas",))
        frames: list[np.ndarray] = []
        prompt = self._prompt(inputs)
        call = SteppedCall(
            lambda checkpoint: self._generate(prompt, streamer=CheckpointStreamer(checkpoint)),
            name=f"talker-{request.request_id}",
        )
        sent = 0
        try:
            done = False
            while not done:
                goal = sent + (self.chunk_frames if sent else self.first_chunk_frames)
                self._capture = frames
                try:
                    done = take_turn(call, state, self.model, has_at_least(frames, len(frames) + 1))
                finally:
                    self._capture = None
                if len(frames) < goal and not done:
                    yield None
                    continue
                yield self._chunk(request, frames, sent, last=done)
                sent = len(frames)
        finally:
            call.close()


def _too_short(inputs: TalkerInput) -> bool:
    """An answer of fewer than 2 tokens (``max_tokens`` 1, or an immediate ``<|im_end|>``) has
    no first text token for the assistant part: it is spoken as no audio (the monolithic
    ``generate`` fails on it)."""
    return len(inputs.sequences) - inputs.prompt_tokens < 2
