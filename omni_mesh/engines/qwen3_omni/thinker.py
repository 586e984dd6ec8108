"""qwen3-omni stage 0, the thinker: Qwen3-Omni-MoE's thinker (audio encoder + MoE LM) on
transformers.

Computes what ``Qwen3OmniMoeThinkerForConditionalGeneration.generate`` gives when the monolithic
model's ``generate`` calls it (``output_hidden_states``, ``eos_token_id`` = ``<|im_end|>``).
Sampling: the request's ``temperature`` (0 or unset: greedy, as the folder's generation config
has it for the tiny model), ``top_p``, ``top_k``, drawn from the request's own generator seeded
as ``torch.manual_seed(seed)`` seeds the process (``row_sampling.row_generator``);
``max_tokens`` (default ``engine_extras.max_tokens``, 64; at most
``engine_extras.max_tokens_limit``, 1024).

Continuous batching: every running request of the engine is a row of one
:class:`ThinkerBatch` (``thinker_batch``): each prefills alone, then one batched
forward per step gives every row its next token; the engine runs that step in ``before_step``,
once per core step, and requests opened since the last step join it. A request leaves on
``<|im_end|>``, at ``max_tokens`` or when its stream is closed (an abort); its tokens are those
``generate`` gives it alone.

Input fields: ``messages`` (the chat route's conversation, JSON) or ``prompt``; ``voice`` (a
speaker of the folder's talker config, checked here so a bad one costs no compute). Output
(what the talker needs, see ``processors``): arrays ``sequences`` int64 [P+N],
``thinker_embed`` and ``thinker_hidden`` float32 [P+N-1, D] (the input embeddings and the hidden
states of ``talker_config.accept_hidden_layer`` of every position the thinker ran),
``tts_special`` float32 [3, D] (the input embeddings of tts_bos, tts_eos, tts_pad) and, with
audio, ``audio_feature_lengths`` int64 [A]; fields ``prompt_tokens`` (P), ``generated_tokens``
(N), ``voice``, ``text``. Final: ``text`` (special tokens dropped), ``finish_reason`` (stop:
``<|im_end|>``, else length), ``prompt_tokens``, ``completion_tokens``.

Streaming (``async_chunk``): the text goes to the client as it is generated, every
``engine_extras.chunk_tokens`` tokens (default 1; later when those tokens end inside a UTF-8
character), in results with ``forward=False`` (for the client alone). The talker takes its input
as a stream (its spec's ``stream_input``): the answer's positions go on in chunks as they are
made (``answer.AnswerChunks``: the first once the first answer token was fed, then every
``engine_extras.talker_chunk_tokens``, default 2; 0 hands the whole answer on with the last
result). The chunks' texts concatenated are the whole text, their arrays the whole output.
Not streaming, a request still runs in the batch and
yields one whole result when it ends.

Split (deploy ``prefill:``): prefill and decode replicas, the prompt's KV cache, first token,
positions, sampler state and prompt hidden states moved engine to engine over NIXL
(``batching/kv_split.py``, ``kv/exchange.py``); the decode replica's answer is the unsplit one.

On vLLM: ``engine_extras.backend: vllm`` runs vLLM's own thinker instead, tapped for the same
hidden states (``vllm_thinker.py``); ``auto`` picks it where vLLM is installed.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_mesh.engines.base import (
    EngineConfigError,
    EngineContext,
    EngineInputError,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)
from omni_mesh.engines.batching.frame_batch import Row
from omni_mesh.engines.batching.frame_engine import FrameEngine
from omni_mesh.engines.batching.frame_stream import Chunker
from omni_mesh.engines.batching.kv_split import KvSplit
from omni_mesh.engines.batching.row_sampling import Sampling, row_generator
from omni_mesh.engines.extras import extra_int
from omni_mesh.engines.hf.common import load_part, model_folder, parameter_count
from omni_mesh.engines.qwen3_omni.answer import (
    AnswerChunks,
    TextDeltas,
    no_text,
    talker_chunk_tokens,
    thinker_answer,
)
from omni_mesh.engines.qwen3_omni.inputs import (
    ThinkerPrompt,
    answer_tokens,
    request_conversation,
    thinker_prompt,
)
from omni_mesh.engines.qwen3_omni.speakers import speaker_name
from omni_mesh.engines.qwen3_omni.thinker_batch import ThinkerBatch, ThinkerRow

DEFAULT_MODEL = "tiny-qwen3-omni"

logger = logging.getLogger(__name__)


@dataclass
class ThinkerInput:
    prompt: ThinkerPrompt
    voice: str
    max_tokens: int
    sampling: Sampling


#: ``engine_extras.backend``: the engine that runs the thinker.
BACKENDS = ("transformers", "vllm", "auto")


class Qwen3OmniThinkerEngine(FrameEngine[ThinkerInput]):
    """Qwen3-Omni's thinker (module docstring)."""

    splits_prefill = True
    model: Any

    @classmethod
    def engine_for(cls, ctx: EngineContext) -> type[StageEngine]:
        """``engine_extras.backend``: ``transformers`` (this class, the default), ``vllm``
        (vLLM's own thinker, ``vllm_thinker.py``) or ``auto`` (vLLM where it is installed)."""
        backend = ctx.config.engine_extras.get("backend", "transformers")
        if backend not in BACKENDS:
            raise EngineConfigError(
                f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.backend must be "
                f"one of {', '.join(BACKENDS)}, got {backend!r}"
            )
        if backend == "auto":
            backend = "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
        if backend == "transformers":
            return cls
        from omni_mesh.engines.qwen3_omni.vllm_thinker import Qwen3OmniVllmThinkerEngine

        return Qwen3OmniVllmThinkerEngine

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
        self.first_chunk_frames = self.chunk_frames = self.chunk_tokens
        self.talker_chunk_tokens = talker_chunk_tokens(self.ctx)
        layer = self.config.talker_config.accept_hidden_layer
        self.batch = ThinkerBatch(self.model, self.config.im_end_token_id, layer)
        if self.ctx.config.prefill is not None:
            self.kv = KvSplit(self.ctx, self.batch, self.batch.token_bytes())
        return parameter_count(self.model)

    def parse(self, request: EngineRequest) -> ThinkerInput:
        fields = self.reader(request)
        voice = speaker_name(fields, self.config.talker_config.speaker_id)
        conv = request_conversation(fields, int(self.features.sampling_rate))
        max_tokens = answer_tokens(fields, request.sampling, self.max_tokens, self.max_tokens_limit)
        try:
            tensors = thinker_prompt(self.tokenizer, self.features, conv)
        except EngineInputError as exc:
            raise fields.error("field", "messages", f"unusable: {exc}") from None
        except Exception as exc:  # the tokenizer's or the feature extractor's own checks
            raise fields.error(
                "field", "messages", f"could not be prepared: {type(exc).__name__}: {exc}"
            ) from None
        return ThinkerInput(tensors, voice, max_tokens, _sampling(request))

    def row(self, request: EngineRequest, inputs: ThinkerInput) -> ThinkerRow:
        streamed = self.talker_chunk_tokens and request.whole and not request.kv_transfer
        return ThinkerRow(
            request.request_id,
            row_generator(request.seed, self.device),
            prompt=inputs.prompt,
            sampling=inputs.sampling,
            max_tokens=inputs.max_tokens,
            voice=inputs.voice,
            handoff=AnswerChunks(self.talker_chunk_tokens) if streamed else None,
        )

    def chunker(self, request: EngineRequest, row: Row) -> Chunker:
        assert isinstance(row, ThinkerRow)
        return functools.partial(self._chunk, request, row)

    def _chunk(
        self,
        request: EngineRequest,
        row: ThinkerRow,
        frames: list[np.ndarray],
        sent: int,
        last: bool,
    ) -> EngineResult | None:
        """The text of ``frames[sent:]`` (its tokens) for the client, or None while it is no
        new text, with the answer's next chunk for the talker when one is due (a streamed
        hand-off: ``AnswerChunks``); the last: the whole output (or its last chunk), its final
        text what was not sent yet."""
        if row.text is None:
            row.text = TextDeltas(self.tokenizer)
        before = row.text.sent  # the text handed out so far
        if last:
            result = self._result(request, row)
            if row.handoff is not None:
                result.output = row.handoff.last(result.output)
            assert result.final is not None
            text = str(result.final.fields["text"])
            if not text.startswith(before):  # a decode that changed its past: should not happen
                logger.warning("streamed text is not a prefix request_id=%s", request.request_id)
            result.final.fields["text"] = text[len(before) :]
            return result
        new = row.text.delta(row.tokens[: len(frames)])
        delta = StageData(fields={"text": new}) if new else None
        handed = self._handoff(row)
        if handed is not None:
            return EngineResult(
                request.request_id, output=handed, final=delta or no_text(), last=False
            )
        if delta is None:
            return None
        return EngineResult(request.request_id, final=delta, last=False, forward=False)

    def _handoff(self, row: ThinkerRow) -> StageData | None:
        """The answer's next chunk for the talker, when one is due."""
        handoff, prompt = row.handoff, row.prompt
        if handoff is None or prompt is None:
            return None
        rows = sum(int(e.shape[0]) for e in row.embeds)
        if not handoff.due(int(prompt.input_ids.shape[1]), rows):
            return None
        items = row.handoff_items
        row.handoff_items = len(row.embeds)
        lengths = None
        if prompt.feature_attention_mask is not None:
            lengths = prompt.feature_attention_mask.sum(-1).numpy()
        return handoff.chunk(
            prompt_ids=prompt.input_ids[0].cpu().numpy(),
            answer=row.tokens,
            embeds=_f32(torch.cat(row.embeds[items:])),
            hidden=_f32(torch.cat(row.hidden[items:])),
            tts_special=self._special_embeds(),
            audio_lengths=lengths,
            voice=row.voice,
        )

    def _special_embeds(self) -> np.ndarray:
        """The input embeddings of tts_bos, tts_eos, tts_pad, float32 [3, D]."""
        special = torch.tensor(
            [
                self.config.tts_bos_token_id,
                self.config.tts_eos_token_id,
                self.config.tts_pad_token_id,
            ],
            device=self.device,
        )
        with torch.inference_mode():
            return _f32(self.model.get_input_embeddings()(special))

    def _result(self, request: EngineRequest, row: ThinkerRow) -> EngineResult:
        prompt = row.prompt
        assert prompt is not None
        lengths = None
        if prompt.feature_attention_mask is not None:
            lengths = prompt.feature_attention_mask.sum(-1).numpy()
        output, final = thinker_answer(
            tokenizer=self.tokenizer,
            im_end=int(self.config.im_end_token_id),
            prompt_ids=prompt.input_ids[0].cpu().numpy(),
            answer=row.tokens,
            embeds=_f32(torch.cat(row.embeds)),
            hidden=_f32(torch.cat(row.hidden)),
            tts_special=self._special_embeds(),
            audio_lengths=lengths,
            voice=row.voice,
        )
        return EngineResult(request.request_id, output=output, final=final)


def _sampling(request: EngineRequest) -> Sampling:
    """generate()'s sampling: greedy unless the request asks for a temperature > 0."""
    sampling = request.sampling
    if sampling is None or not sampling.temperature:
        return Sampling(False)
    return Sampling(
        True,
        temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.top_p is not None else 1.0,
        top_k=sampling.top_k if sampling.top_k else 0,
    )


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()
