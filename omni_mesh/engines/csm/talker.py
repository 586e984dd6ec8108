"""csm-tts stage 0, the talker: CSM's backbone with its depth decoder, on transformers.

Each step the Llama backbone picks codebook 0 of a frame and the depth decoder the other
``num_codebooks - 1`` codebooks, as ``CsmForConditionalGeneration.generate`` does when a user of
the monolithic model calls it (the prompt through the folder's ``CsmProcessor`` chat template,
``<|begin_of_text|>[speaker]text<|end_of_text|>``), only without ``output_audio``: the Mimi
codec is the next stage's. The stage loads the checkpoint's backbone, depth decoder, text
embedding and head, and leaves the ``codec_model.*`` tensors unread.

Sampling: the folder's generation config (``do_sample``, ``temperature``, ``top_k`` and their
``depth_decoder_*`` twins, as a plain ``generate()`` uses them); ``engine_extras`` ``do_sample``,
``temperature``, ``top_k`` override both models alike. Each request samples from its own
generator seeded by its seed, as ``torch.manual_seed(seed)`` before the monolithic ``generate``.
``max_frames`` (default 256, 20.5 s at 12.5 frames/s) caps a request's frames; the request's
``max_tokens`` (at most ``max_frames``) lowers the cap. An utterance ends at CSM's end frame (every
codebook ``codebook_eos_token_id``), which is not part of the output, as the monolithic decode
cuts the codes there.

Input fields: ``prompt`` (the text to speak, UTF-8, at most ``max_prompt_bytes``, default 4096),
``voice`` (a CSM speaker id ``"0"`` … ``"N-1"``, N = ``engine_extras.speakers``, default 2;
``default`` is speaker 0; anything else is a 400 listing the allowed voices), ``max_tokens``.

Continuous batching: every running request of the engine is a row of one :class:`CsmBatch`
(``talker_batch``), whose step makes one frame for all of them with one batched run of the
depth decoder and one batched forward of the backbone; the engine runs that step once per core
step (``before_step``), requests opened since the last step prefill alone and join it, and a
request leaves when it ends or its stream is closed. Its codes equal what it gets alone, and
what the monolithic ``generate`` gives for its seed.

Streaming (``async_chunk``, whole input): a stream yields ``None`` until it has its first
``engine_extras.first_chunk_frames`` frames (default 2: the first audio comes early), then
every ``chunk_frames`` frames (default 10), the new frames' ``codes`` with the
``context_codes`` (up to ``context_frames``, default 25: the codec's left context) before them;
the chunk that holds the last frame is the last. Not streaming, a request still runs in the
batch and yields one whole result when it ends.

Output: array ``codes`` int64 [F, G] (frame-major), fields ``num_frames``, ``frame_offset``;
``context_codes`` int64 [M, G] on every chunk but the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from omni_mesh.engines.base import EngineConfigError, EngineContext, EngineRequest, EngineResult
from omni_mesh.engines.batching.frame_engine import FrameEngine
from omni_mesh.engines.batching.row_sampling import Sampling, row_generator
from omni_mesh.engines.csm.talker_batch import CsmBatch, CsmRow
from omni_mesh.engines.devices import torch_device, torch_dtype
from omni_mesh.engines.extras import extra_bool, extra_float, extra_int
from omni_mesh.engines.fields import DEFAULT_MAX_PROMPT_BYTES, FieldReader
from omni_mesh.engines.hf.codes import codes_chunk
from omni_mesh.engines.hf.common import model_folder, parameter_count

DEFAULT_MODEL = "tiny-csm"
DEFAULT_SPEAKERS = 2


@dataclass
class TalkerInput:
    input_ids: np.ndarray  # [T] int64: the chat-templated prompt
    speaker: int
    frames: int  # this request's cap on frames (max_new_tokens)


@cache
def talker_class() -> Any:
    """``CsmForConditionalGeneration`` without its codec: the talker's part of the folder."""
    from transformers import CsmForConditionalGeneration

    class CsmTalkerForConditionalGeneration(CsmForConditionalGeneration):  # type: ignore[misc]
        _keys_to_ignore_on_load_unexpected = [r"^codec_model\."]

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            del self.codec_model  # built empty (meta) by from_pretrained; never loaded

    return CsmTalkerForConditionalGeneration


def load_talker(folder: Path, ctx: EngineContext | None = None) -> Any:
    """The backbone, depth decoder, text embedding and head of the CSM checkpoint in folder,
    on the stage's device in its dtype (``ctx``; without: the CPU, the checkpoint's dtype)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # not the table of the codec's tensors, left unread
    try:
        model, info = talker_class().from_pretrained(
            str(folder),
            output_loading_info=True,
            dtype="auto" if ctx is None else torch_dtype(ctx),
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise EngineConfigError(f"CSM folder {str(folder)!r} lacks talker tensors {missing[:3]}")
    if ctx is not None:
        model = model.to(torch_device(ctx))
    model.eval()
    return model


class CsmTalkerEngine(FrameEngine[TalkerInput]):
    """CSM's backbone + depth decoder (module docstring)."""

    step_audio_s = 0.08  # one codec frame per row and step: 12.5 Hz

    model: Any

    def build(self, seed: int) -> int:
        from transformers import AutoProcessor

        ctx = self.ctx
        self.max_frames = extra_int(ctx, "max_frames", 256, 1, 1 << 15)
        self.chunk_frames = extra_int(ctx, "chunk_frames", 10, 1, 4096)
        self.first_chunk_frames = extra_int(ctx, "first_chunk_frames", 2, 1, 4096)
        self.context_frames = extra_int(ctx, "context_frames", 25, 0, 4096)
        self.speakers = extra_int(ctx, "speakers", DEFAULT_SPEAKERS, 1, 1 << 16)
        self.max_prompt_bytes = extra_int(
            ctx, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, 1, 1 << 20
        )
        folder = model_folder(ctx, DEFAULT_MODEL)
        self.model = load_talker(folder, ctx)
        self.processor = AutoProcessor.from_pretrained(str(folder))
        self.config = self.model.config
        self.batch = CsmBatch(
            self.model,
            self._sampling(self.model.generation_config),
            self._sampling(self.model.depth_decoder.generation_config),
        )
        return parameter_count(self.model)

    def _sampling(self, gen: Any) -> Sampling:
        """The sampling of the backbone's or the depth decoder's generation config ``gen``, with
        the engine's overrides (module docstring)."""
        ctx = self.ctx
        do_sample = extra_bool(ctx, "do_sample", bool(gen.do_sample))
        if not do_sample:
            return Sampling(False)
        temperature = gen.temperature if gen.temperature is not None else 1.0
        top_k = gen.top_k if gen.top_k is not None else 50
        return Sampling(
            True,
            temperature=extra_float(ctx, "temperature", float(temperature), 0.01, 10.0),
            top_k=extra_int(ctx, "top_k", int(top_k), 0, 1 << 20),
        )

    def parse(self, request: EngineRequest) -> TalkerInput:
        fields = self.reader(request)
        text = fields.prompt_bytes("prompt", self.max_prompt_bytes).decode("utf-8")
        speaker = self._speaker(fields)
        frames = fields.optional_int("max_tokens", self.max_frames, 1, self.max_frames)
        assert frames is not None
        conversation = [{"role": str(speaker), "content": [{"type": "text", "text": text}]}]
        ids = self.processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
        input_ids = np.asarray(ids["input_ids"][0], dtype=np.int64)
        limit = int(self.config.max_position_embeddings)
        if len(input_ids) + frames > limit:
            raise fields.error(
                "field",
                "prompt",
                f"is {len(input_ids)} tokens; with {frames} frames that is over the model's "
                f"{limit} positions",
            )
        return TalkerInput(input_ids, speaker, frames)

    def _speaker(self, fields: FieldReader) -> int:
        voice = fields.optional_str("voice", "default").strip().lower()
        if voice == "default":
            return 0
        if voice.isdigit() and int(voice) < self.speakers:
            return int(voice)
        allowed = ", ".join(["default", *(str(i) for i in range(min(self.speakers, 8)))])
        if self.speakers > 8:
            allowed += f", … {self.speakers - 1}"
        raise fields.error("field", "voice", f"names unknown voice {voice!r}; allowed: {allowed}")

    def row(self, request: EngineRequest, inputs: TalkerInput) -> CsmRow:
        return CsmRow(
            request.request_id,
            row_generator(request.seed, self.model.device),
            input_ids=inputs.input_ids,
            cap=inputs.frames,
        )

    def chunk(
        self, request: EngineRequest, frames: list[np.ndarray], sent: int, last: bool
    ) -> EngineResult:
        groups = int(self.config.num_codebooks)
        return codes_chunk(request.request_id, frames, sent, groups, self.context_frames, last=last)
