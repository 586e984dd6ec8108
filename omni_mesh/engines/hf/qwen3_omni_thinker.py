"""qwen3-omni stage 0, the thinker: Qwen3-Omni-MoE's thinker (audio encoder + MoE LM) on
transformers.

Runs ``Qwen3OmniMoeThinkerForConditionalGeneration.generate`` exactly as the monolithic model's
``generate`` calls it (``output_hidden_states``, ``eos_token_id`` = ``<|im_end|>``), one request
at a time, with the request's own RNG stream (``common.seeded_rng``). Sampling: the request's
``temperature`` (0 or unset: greedy, as the folder's generation config has it for the tiny
model), ``top_p``, ``top_k``; ``max_tokens`` (default ``engine_extras.max_tokens``, 64; at most
``engine_extras.max_tokens_limit``, 1024).

Input fields: ``messages`` (the chat route's conversation, JSON) or ``prompt``; ``voice`` (a
speaker of the folder's talker config, checked here so a bad one costs no compute). Output
(what the talker needs, see ``qwen3_omni_processors``): arrays ``sequences`` int64 [P+N],
``thinker_embed`` and ``thinker_hidden`` float32 [P+N-1, D] (the input embeddings and the hidden
states of ``talker_config.accept_hidden_layer`` of every position the thinker ran),
``tts_special`` float32 [3, D] (the input embeddings of tts_bos, tts_eos, tts_pad) and, with
audio, ``audio_feature_lengths`` int64 [A]; fields ``prompt_tokens`` (P), ``generated_tokens``
(N), ``voice``, ``text``. Final: ``text`` (special tokens dropped), ``finish_reason`` (stop:
``<|im_end|>``, else length), ``prompt_tokens``, ``completion_tokens``.

Streaming (``async_chunk``): the text goes to the client as it is generated, every
``engine_extras.chunk_tokens`` tokens (default 1), in results with ``forward=False`` (for the
client alone: the talker needs the whole answer's hidden states, it gets them with the last
result as one whole input). The chunks' texts concatenated are the whole text.

Why not vLLM: vLLM's ``qwen3_omni_moe_thinker`` returns tokens, not the per-layer hidden
states and input embeddings the talker conditions on; handing those out needs a model class
registered through vLLM's plugin mechanism that returns them (a follow-up).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_mesh.engines.base import EngineInputError, EngineRequest, EngineResult, StageData
from omni_mesh.engines.hf.common import load_part, model_folder, parameter_count, seeded_rng
from omni_mesh.engines.hf.qwen3_omni_inputs import ThinkerPrompt, conversation, thinker_prompt
from omni_mesh.engines.hf.speakers import speaker_name
from omni_mesh.engines.hf.stepped import (
    CheckpointStreamer,
    SteppedCall,
    TurnState,
    has_at_least,
    take_turn,
)
from omni_mesh.engines.reference.common import ReferenceEngine, extra_int

DEFAULT_MODEL = "tiny-qwen3-omni"

logger = logging.getLogger(__name__)


@dataclass
class ThinkerInput:
    prompt: ThinkerPrompt
    voice: str
    max_tokens: int
    sampling: dict[str, Any]


class Qwen3OmniThinkerEngine(ReferenceEngine[ThinkerInput]):
    """Qwen3-Omni's thinker (module docstring)."""

    model: Any

    def build(self, seed: int) -> int:
        from transformers import AutoFeatureExtractor, AutoTokenizer, Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeThinkerForConditionalGeneration,
        )

        self.max_tokens = extra_int(self.ctx, "max_tokens", 64, 1, 8192)
        self.max_tokens_limit = extra_int(self.ctx, "max_tokens_limit", 1024, 1, 32768)
        self.chunk_tokens = extra_int(self.ctx, "chunk_tokens", 1, 1, 4096)
        folder = model_folder(self.ctx, DEFAULT_MODEL)
        self.config = Qwen3OmniMoeConfig.from_pretrained(str(folder))
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.features = AutoFeatureExtractor.from_pretrained(str(folder))
        self.model = load_part(
            Qwen3OmniMoeThinkerForConditionalGeneration,
            folder,
            self.config.thinker_config,
            "thinker",
            self.ctx,
        )
        self.device = self.model.device
        return parameter_count(self.model)

    def parse(self, request: EngineRequest) -> ThinkerInput:
        fields = self.reader(request)
        voice = speaker_name(fields, self.config.talker_config.speaker_id)
        messages = fields.data.fields.get("messages")
        prompt = fields.data.fields.get("prompt")
        conv = conversation(
            fields.where,
            messages if isinstance(messages, str) else None,
            prompt if isinstance(prompt, str) else None,
            int(self.features.sampling_rate),
        )
        sampling = request.sampling
        requested = fields.optional_int("max_tokens", None, 1, 1 << 20)
        if sampling is not None and sampling.max_tokens is not None:
            requested = min(requested or sampling.max_tokens, sampling.max_tokens)
        max_tokens = requested or self.max_tokens
        if max_tokens > self.max_tokens_limit:
            raise fields.error(
                "field",
                "max_tokens",
                f"is {max_tokens}; this stage generates at most {self.max_tokens_limit} "
                "(engine_extras.max_tokens_limit)",
            )
        try:
            tensors = thinker_prompt(self.tokenizer, self.features, conv)
        except EngineInputError as exc:
            raise fields.error("field", "messages", f"unusable: {exc}") from None
        except Exception as exc:  # the tokenizer's or the feature extractor's own checks
            raise fields.error(
                "field", "messages", f"could not be prepared: {type(exc).__name__}: {exc}"
            ) from None
        return ThinkerInput(tensors, voice, max_tokens, _sampling(request))

    def run(
        self, request: EngineRequest, inputs: ThinkerInput, generator: torch.Generator
    ) -> EngineResult:
        with seeded_rng(request.seed, self.device):
            return self._result(request, inputs, self._generate(inputs))

    def run_chunks(
        self, request: EngineRequest, inputs: ThinkerInput, generator: torch.Generator
    ) -> Iterator[EngineResult]:
        """The answer's text every ``chunk_tokens`` tokens, for the client alone (no next-stage
        input), then the whole output: the talker gets one whole input (module docstring)."""
        state = TurnState.start(request.seed, ("rope_deltas",), self.device)
        tokens: list[int] = []
        call = SteppedCall(
            lambda checkpoint: self._generate(
                inputs, streamer=CheckpointStreamer(checkpoint, tokens.append)
            ),
            name=f"thinker-{request.request_id}",
        )
        sent = ""
        try:
            while not take_turn(
                call, state, self.model, has_at_least(tokens, len(tokens) + self.chunk_tokens)
            ):
                text = self._stable_text(tokens)
                if len(text) > len(sent):
                    delta = StageData(fields={"text": text[len(sent) :]})
                    yield EngineResult(request.request_id, final=delta, last=False, forward=False)
                    sent = text
            result = self._result(request, inputs, call.result)
        finally:
            call.close()
        assert result.final is not None
        text = str(result.final.fields["text"])
        if not text.startswith(sent):  # a decode that changed its past: should not happen
            logger.warning("streamed text is not a prefix request_id=%s", request.request_id)
        result.final.fields["text"] = text[len(sent) :]
        yield result

    def _stable_text(self, tokens: list[int]) -> str:
        """The text of ``tokens`` that later tokens cannot change (no trailing partial
        UTF-8 character)."""
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True)).rstrip("\ufffd")

    def _generate(self, inputs: ThinkerInput, **extra: Any) -> Any:
        prompt, device = inputs.prompt, self.device
        kwargs: dict[str, Any] = {}
        features, mask = prompt.input_features, prompt.feature_attention_mask
        if features is not None and mask is not None:
            kwargs["input_features"] = features.to(device, self.model.dtype)
            kwargs["feature_attention_mask"] = mask.to(device)
        return self.model.generate(
            input_ids=prompt.input_ids.to(device),
            attention_mask=prompt.attention_mask.to(device),
            max_new_tokens=inputs.max_tokens,
            eos_token_id=self.config.im_end_token_id,
            use_audio_in_video=False,
            output_hidden_states=True,
            return_dict_in_generate=True,
            **inputs.sampling,
            **kwargs,
            **extra,
        )

    def _result(self, request: EngineRequest, inputs: ThinkerInput, result: Any) -> EngineResult:
        prompt = inputs.prompt
        layer = self.config.talker_config.accept_hidden_layer
        embed = torch.cat([h[0] for h in result.hidden_states], dim=1)[0]
        hidden = torch.cat([h[layer] for h in result.hidden_states], dim=1)[0]
        special = torch.tensor(
            [
                self.config.tts_bos_token_id,
                self.config.tts_eos_token_id,
                self.config.tts_pad_token_id,
            ],
            device=self.device,
        )
        sequences = result.sequences[0].cpu()
        prompt_tokens = int(prompt.input_ids.shape[1])
        generated = sequences[prompt_tokens:]
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        stopped = len(generated) and int(generated[-1]) == self.config.im_end_token_id
        arrays = {
            "sequences": sequences.numpy().astype(np.int64),
            "thinker_embed": _f32(embed),
            "thinker_hidden": _f32(hidden),
            "tts_special": _f32(self.model.get_input_embeddings()(special)),
        }
        if prompt.feature_attention_mask is not None:
            lengths = prompt.feature_attention_mask.sum(-1)
            arrays["audio_feature_lengths"] = lengths.numpy().astype(np.int64)
        output = StageData(
            fields={
                "text": text,
                "voice": inputs.voice,
                "prompt_tokens": prompt_tokens,
                "generated_tokens": len(generated),
            },
            arrays=arrays,
        )
        final = StageData(
            {
                "text": text,
                "finish_reason": "stop" if stopped else "length",
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(generated),
            }
        )
        return EngineResult(request.request_id, output=output, final=final)


def _sampling(request: EngineRequest) -> dict[str, Any]:
    """generate() sampling kwargs: greedy unless the request asks for a temperature > 0."""
    sampling = request.sampling
    if sampling is None or not sampling.temperature:
        return {"do_sample": False}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": sampling.temperature}
    kwargs["top_p"] = sampling.top_p if sampling.top_p is not None else 1.0
    kwargs["top_k"] = sampling.top_k if sampling.top_k else 0
    return kwargs


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()
