"""qwen3-omni stage 0 on vLLM: vLLM's own Qwen3-Omni thinker, handing the talker what the
transformers thinker hands it (issue 33).

Chosen with ``engine_extras.backend: vllm`` (``Qwen3OmniThinkerEngine.engine_for``). The model
is vLLM's ``Qwen3OmniMoeThinkerForConditionalGeneration`` tapped for the input embeddings and
the hidden states of ``talker_config.accept_hidden_layer`` (``engines/vllm/hidden_tap.py``):
every prompt and answer position the thinker ran, split per request from each step's rows,
under vLLM's continuous batching, chunked prefill and preemption. Text and ``input_audio``
parts go through vLLM's multimodal processor (the folder's ``Qwen3OmniMoeProcessor``).

Input and output are those of the transformers thinker (``thinker.py``): fields ``messages`` or
``prompt``, ``voice``, ``max_tokens``; output arrays ``sequences``, ``thinker_embed``,
``thinker_hidden``, ``tts_special`` (and ``audio_feature_lengths`` with audio), fields ``text``,
``voice``, ``prompt_tokens``, ``generated_tokens``; the final text with ``finish_reason`` and
usage; under ``async_chunk`` the text streams to the client (``forward=False`` chunks) and the
answer goes on to the talker in chunks as it is made (``answer.AnswerChunks``,
``engine_extras.talker_chunk_tokens``), as the transformers thinker hands it on. Greedy
unless the request asks for a temperature; sampled tokens are vLLM's (seeded per request), not
transformers'.

What the tap needs of vLLM is checked at start, each a config error naming the setting (exit 2):
one model in the engine's process (``tensor_parallel_size`` and the other parallel sizes 1), no
prefix caching, no asynchronous scheduling, no speculative decoding; and a vLLM version it was
built against (:data:`VLLM_VERSIONS`).

Split (deploy ``prefill:``): vLLM's connector moves the prompt's KV and the prompt's rows move
beside it over NIXL (``vllm_thinker_split.py``); the decode replica's answer, streamed hand-off
included, is the unsplit one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni_mesh.data_plane.kv_transfer import KvTransferError, is_prefill
from omni_mesh.engines.base import (
    EngineConfigError,
    EngineContext,
    EngineInputError,
    EngineRequest,
)
from omni_mesh.engines.extras import extra_int
from omni_mesh.engines.fields import FieldReader
from omni_mesh.engines.hf.common import model_folder
from omni_mesh.engines.qwen3_omni.answer import AnswerChunks, talker_chunk_tokens
from omni_mesh.engines.qwen3_omni.inputs import (
    answer_tokens,
    audio_features,
    check_audio_lengths,
    request_conversation,
)
from omni_mesh.engines.qwen3_omni.speakers import speaker_name
from omni_mesh.engines.qwen3_omni.vllm_thinker_split import PromptRows
from omni_mesh.engines.qwen3_omni.vllm_thinker_stream import ThinkerStream, ThinkerTexts
from omni_mesh.engines.vllm.args import build_engine_args
from omni_mesh.engines.vllm.engine import VllmEngine
from omni_mesh.engines.vllm.hidden_tap import StepRows, tapped
from omni_mesh.engines.vllm.stream import VllmStream

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny-qwen3-omni"
#: The architecture name the tapped thinker is registered under with vLLM.
TAP_ARCH = "OmniMeshQwen3OmniThinker"
#: vLLM releases the tap was built and tested against (the scheduler and runner internals it
#: reads: ``update_from_output``, ``ModelRunnerOutput.req_ids``, the scheduler output's
#: ``num_computed_tokens``, ``set_aux_hidden_state_layers``).
VLLM_VERSIONS = ("0.32.", "0.33.")
#: vLLM settings the tap cannot work with: each must stay off (a stage setting names it).
MUST_BE_OFF = {
    "enable_prefix_caching": "cached prompt positions are never computed, so never tapped",
    "async_scheduling": "the next step's forward would overwrite the tapped rows first",
    "speculative_config": "a draft model's rows are not the thinker's",
}


@dataclass
class ThinkerInputs:
    prompt: dict[str, Any]  # vLLM's prompt: text (chat template applied), audio
    voice: str
    max_tokens: int
    audio_lengths: np.ndarray | None  # int64 [A]: the feature extractor's frames per audio


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_settings(ctx: EngineContext, version: str) -> None:
    """What the tap needs of vLLM (module docstring): an EngineConfigError naming the first
    setting that it cannot work with."""
    where = f"stage {ctx.stage.name!r} ({ctx.pipeline.name}), vLLM thinker"
    if not version.startswith(VLLM_VERSIONS):
        raise EngineConfigError(
            f"{where}: vLLM {version} is not one it was built for "
            f"({', '.join(v + 'x' for v in VLLM_VERSIONS)}); use engine_extras.backend: "
            "transformers, or a vLLM it knows"
        )
    config = ctx.config
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if (getattr(config, key) or 1) != 1:
            raise EngineConfigError(
                f"{where}: {key} must be 1 (the hidden states are tapped from the one model "
                "in the engine's process); engine_extras.backend: transformers runs larger "
                "thinkers, see docs/operations.md"
            )
    for key, why in MUST_BE_OFF.items():
        if config.engine_args.get(key) not in (None, False):
            raise EngineConfigError(f"{where}: engine_args.{key} must be off: {why}")


_TAP_CLASS: Any = None


def tap_class() -> Any:
    """The tapped thinker class, made and registered with vLLM once per process."""
    global _TAP_CLASS
    if _TAP_CLASS is None:
        from vllm import ModelRegistry
        from vllm.model_executor.models.qwen3_omni_moe_thinker import (
            Qwen3OmniMoeThinkerForConditionalGeneration as Base,
        )

        _TAP_CLASS = tapped(Base, TAP_ARCH, _tapped_layers)
        # The class object, not a "module:Class" string: vLLM inspects strings in a subprocess.
        ModelRegistry.register_model(TAP_ARCH, _TAP_CLASS)
    return _TAP_CLASS


def _tapped_layers(hf_config: Any) -> tuple[int, ...]:
    """Layer 0 (the input embeddings) and the talker's accept layer."""
    return (0, int(hf_config.talker_config.accept_hidden_layer))


class Qwen3OmniVllmThinkerEngine(VllmEngine):
    """Qwen3-Omni's thinker on vLLM (module docstring)."""

    splits_prefill = True

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.chunk_tokens = self.first_chunk_tokens = extra_int(ctx, "chunk_tokens", 1, 1, 4096)
        self.max_tokens = extra_int(ctx, "max_tokens", 64, 1, 8192)
        self.max_tokens_limit = extra_int(ctx, "max_tokens_limit", 1024, 1, 32768)
        self.max_audios = extra_int(ctx, "max_audios", 4, 1, 64)
        self.talker_chunk_tokens = talker_chunk_tokens(ctx)
        self.where = f"stage {ctx.stage.name!r} ({ctx.pipeline.name} stage {ctx.stage.stage_id})"
        self._owners: dict[str, ThinkerStream | None] = {}  # scheduler id -> its stream
        self.folder = Path()
        self.hf: Any = None
        self.features: Any = None
        self.texts: ThinkerTexts | None = None
        self.prompt_rows: PromptRows | None = None  # a split stage's (vllm_thinker_split)

    # ---- lifecycle -----------------------------------------------------------------------

    def engine_args(self) -> dict[str, Any]:
        check_settings(self.ctx, vllm_version())
        if "model" in self.ctx.config.engine_args:
            raise EngineConfigError(
                f"{self.where}: engine_args.model: name the folder in engine_extras.model, as "
                "every qwen3-omni stage does"
            )
        self.folder = model_folder(self.ctx, DEFAULT_MODEL)
        with_model = {**self.ctx.config.engine_args, "model": str(self.folder)}
        config = self.ctx.config.model_copy(update={"engine_args": with_model})
        args = build_engine_args(config, self.cache_dir)
        overrides = dict(args.get("hf_overrides") or {})
        overrides["architectures"] = [TAP_ARCH]
        args["hf_overrides"] = overrides
        args["enable_prefix_caching"] = False
        args["async_scheduling"] = False
        args.setdefault("limit_mm_per_prompt", {"image": 0, "video": 0, "audio": self.max_audios})
        tap_class()
        return args

    def loaded(self, args: dict[str, Any]) -> None:
        import torch
        from transformers import AutoFeatureExtractor, Qwen3OmniMoeConfig

        taps = tap_class().instances
        if not taps:
            raise EngineConfigError(f"{self.where}: vLLM did not build the tapped thinker")
        tap = taps[-1]
        StepRows(self._llm.engine_core.engine_core.scheduler, tap, self._take_rows).install()
        self.hf = Qwen3OmniMoeConfig.from_pretrained(str(self.folder))
        self.features = AutoFeatureExtractor.from_pretrained(str(self.folder))
        special = [self.hf.tts_bos_token_id, self.hf.tts_eos_token_id, self.hf.tts_pad_token_id]
        with torch.inference_mode():
            embeds = tap.embed_input_ids(torch.tensor(special, device=tap.tap.device))
        self.texts = ThinkerTexts(
            tokenizer=self._tokenizer,
            im_end=int(self.hf.im_end_token_id),
            tts_special=embeds.to("cpu", torch.float32).numpy(),
        )
        if self.ctx.config.prefill is not None:
            self.prompt_rows = PromptRows(self.ctx, self.texts.tts_special.shape[1])

    def close(self) -> None:
        super().close()
        if self.prompt_rows is not None:
            self.prompt_rows.close()

    # ---- requests ------------------------------------------------------------------------

    def _add(self, request: EngineRequest) -> ThinkerStream:
        assert self.texts is not None
        inputs = self._parse(request)
        prefill = is_prefill(request.kv_transfer)
        kv_transfer, pulling = request.kv_transfer, None
        if kv_transfer and self.prompt_rows is None:
            raise EngineInputError(f"{self.where}: kv_transfer at a stage that is not split")
        if kv_transfer and not prefill:  # a decode: vLLM pulls the KV, we the prompt rows
            assert self.prompt_rows is not None
            kv_transfer, pulling = self.prompt_rows.pull(kv_transfer, request.request_id)
            if pulling is None:  # no rows to read: prefilled here, a failed hand-off
                self.kv_counts.failed += 1
        params = self._thinker_sampling(request, inputs)
        local = self._kv_part(request, kv_transfer, params)
        if local is None and pulling is not None:  # vLLM cannot pull: prefilled here
            pulling.cancel()
            pulling = None
        vid = self._submit(request, inputs.prompt, params)
        stream = ThinkerStream(
            engine=self,
            vid=vid,
            request=request,
            streaming=self.ctx.async_chunk and request.whole and not prefill,
            chunk_tokens=self.chunk_tokens,
            texts=self.texts,
            voice=inputs.voice,
            audio_lengths=inputs.audio_lengths,
            handoff=(
                AnswerChunks(self.talker_chunk_tokens)
                if self.talker_chunk_tokens and request.whole and not prefill
                else None
            ),
            hold=self.prompt_rows.hold if prefill and self.prompt_rows is not None else None,
        )
        stream.pulling = pulling
        if local is not None:
            stream.local_retry = (inputs.prompt, local)
        self._streams[vid] = stream
        return stream

    def _parse(self, request: EngineRequest) -> ThinkerInputs:
        fields = FieldReader(f"{self.where} request {request.request_id!r}", request.data)
        voice = speaker_name(fields, self.hf.talker_config.speaker_id)
        rate = int(self.features.sampling_rate)
        conv = request_conversation(fields, rate)
        max_tokens = answer_tokens(fields, request.sampling, self.max_tokens, self.max_tokens_limit)
        text = self._tokenizer.apply_chat_template(
            conv.messages, add_generation_prompt=True, tokenize=False
        )
        vllm_prompt: dict[str, Any] = {"prompt": text}
        lengths = None
        if conv.audios:
            try:
                check_audio_lengths(conv.audios, self.features)
            except EngineInputError as exc:
                raise fields.error("field", "messages", f"unusable: {exc}") from None
            if len(conv.audios) > self.max_audios:
                raise fields.error(
                    "field",
                    "messages",
                    f"holds {len(conv.audios)} audios; this stage takes at most "
                    f"{self.max_audios} (engine_extras.max_audios)",
                )
            vllm_prompt["multi_modal_data"] = {"audio": [(a, rate) for a in conv.audios]}
            _, mask = audio_features(conv.audios, self.features)
            lengths = mask.sum(-1).numpy().astype(np.int64)
        return ThinkerInputs(vllm_prompt, voice, max_tokens, lengths)

    def _thinker_sampling(self, request: EngineRequest, inputs: ThinkerInputs) -> Any:
        """generate()'s: greedy unless the request asks for a temperature; stops at
        ``<|im_end|>``, which the answer keeps (as ``generate``'s sequences do)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        assert self.texts is not None
        s = request.sampling
        values: dict[str, Any] = {"temperature": 0.0}
        if s is not None and s.temperature:
            values = {
                "temperature": s.temperature,
                "top_p": s.top_p if s.top_p is not None else 1.0,
                "top_k": s.top_k or 0,
            }
        params = SamplingParams(
            max_tokens=inputs.max_tokens,
            stop_token_ids=[self.texts.im_end],
            seed=request.seed % (1 << 63),
            detokenize=False,
            **values,
        )
        params.output_kind = RequestOutputKind.DELTA
        return params

    def _take_rows(self, scheduler_id: str, first: int, rows: Any) -> None:
        """A step's rows of one request (``StepRows``' sink)."""
        stream = self._owners.get(scheduler_id)
        if stream is None and scheduler_id not in self._owners:
            # vLLM adds 8 random characters to the id it was given: "<vid>-xxxxxxxx"
            vid = scheduler_id if scheduler_id in self._streams else scheduler_id[:-9]
            owner = self._streams.get(vid)
            stream = owner if isinstance(owner, ThinkerStream) else None
            self._owners[scheduler_id] = stream
        if stream is not None:
            stream.take_rows(first, rows)

    def prefill_locally(self, stream: VllmStream) -> None:
        if isinstance(stream, ThinkerStream):
            stream.restart()
        super().prefill_locally(stream)

    def idle(self) -> None:
        super().idle()
        if self.prompt_rows is not None:
            self.prompt_rows.tick()

    def holds_work(self) -> bool:
        return self.prompt_rows is not None and self.prompt_rows.held > 0

    def _rows_in(self) -> None:
        """Decode requests whose prompt rows arrived take them; a failed read runs its request
        again, prefilled here."""
        assert self.prompt_rows is not None
        for stream in [s for s in self._streams.values() if isinstance(s, ThinkerStream)]:
            if stream.pulling is None:
                continue
            try:
                rows = self.prompt_rows.arrived(stream.pulling)
            except KvTransferError as exc:
                logger.warning("request_id=%s prefills here: %s", stream.request_id, exc)
                stream.pulling = None
                if stream.local_retry is not None:
                    self._llm.abort_request([stream.vid])
                    self.prefill_locally(stream)
                continue
            if rows is not None:
                stream.take_pulled(rows)

    def before_step(self, streams: int) -> None:
        if self.prompt_rows is not None:
            self.prompt_rows.tick()
            self._rows_in()
        super().before_step(streams)
        # Requests that finished, were aborted or were never ours leave the map.
        self._owners = {k: s for k, s in self._owners.items() if s is not None and not s.done}
