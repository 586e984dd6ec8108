"""VllmEngine: an autoregressive stage run by vLLM's v1 engine, in the engine process.

One vLLM ``LLMEngine`` per replica, its engine core in-process (no extra processes). It plugs in
under :class:`~omni_mesh.engines.core.EngineCore`: ``open`` adds every admitted request to
vLLM's scheduler, ``before_step`` runs exactly one vLLM step (new requests join the running
batch: continuous batching by vLLM's own scheduler) and hands each request its new tokens;
a stream yields ``None`` while its request has nothing to emit yet. Closing a stream (abort,
deadline, client gone) aborts the request inside vLLM at once, which frees its KV blocks.

Input: ``prompt`` (text) or an int array ``token_ids`` from the upstream stage. When
``engine_extras.chat_template`` is true, the model's chat template is applied to field
``messages`` (the chat route's whole conversation, JSON text) or else to ``prompt`` as one user
message, unless field ``chat_template`` is false (``/v1/completions``: the prompt as given). An
optional ``max_tokens`` field (the prompt's, or set by a processor) caps the output.
Output (``output``, and ``final`` for a text stage): field ``text`` and array ``token_ids``
(int64) of the new tokens, ``logprobs`` (float32, the sampled tokens') when the request asks
for them (a text stage's ``final`` also carries the top-k alternatives and, with field ``echo``,
the prompt: see ``stream.py``), field ``generated_tokens`` (count so far) and, on the last
result, ``finish_reason``; other input fields pass through (``voice``…).
``engine_extras.context_tokens`` adds array ``context_token_ids``: up to that many tokens
generated before the chunk (for a decoder downstream that needs left context).

Streaming (``async_chunk`` and a whole input): the first chunk as soon as the first token
exists (``engine_extras.first_chunk_tokens``, default 1), then one every
``engine_extras.chunk_tokens`` tokens (default 16), the last when vLLM finishes. Otherwise
one result when the request finishes.

Sampling: the request's sampling params (when ``engine_extras.request_sampling`` is true, the
default) over the stage's ``sampling:`` defaults; the seed is the request's (plus the chunk
index for a chunk of an upstream stream), so a replay regenerates the same tokens.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omni_mesh.configs.pipeline_spec import OutputKind
from omni_mesh.data_plane.kv_transfer import (
    KvTransferError,
    decode_params,
    is_prefill,
    prefill_params,
)
from omni_mesh.data_plane.messages import EngineStats
from omni_mesh.engines.base import (
    EngineConfigError,
    EngineContext,
    EngineInputError,
    EngineRequest,
    EngineResult,
    StageEngine,
)
from omni_mesh.engines.extras import extra_bool, extra_int
from omni_mesh.engines.model_cache import default_cache_dir
from omni_mesh.engines.vllm.args import build_engine_args, make_vllm_config
from omni_mesh.engines.vllm.cpu_binding import WorkerSegments, bind_cpu_workers
from omni_mesh.engines.vllm.kv_split import (
    CPU_PROGRESS_DELAY_US,
    KvTransferCounts,
    pace_nixl_progress,
    queued_prefill_tokens,
    with_kv_connector,
)
from omni_mesh.engines.vllm.stream import VllmStream, pass_fields

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 16
DEFAULT_MAX_TOKENS = 64
#: The request sampling fields that override the stage's defaults when set (``None`` = unset).
REQUEST_SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "max_tokens",
    "repetition_penalty",
    "stop",
    "logprobs",
    "ignore_eos",
)


class VllmEngine(StageEngine):
    """A stage engine backed by vLLM (see the module docstring)."""

    splits_prefill = True

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.chunk_tokens = extra_int(ctx, "chunk_tokens", DEFAULT_CHUNK_TOKENS, 1, 4096)
        self.first_chunk_tokens = extra_int(ctx, "first_chunk_tokens", 1, 1, 4096)
        self.context_tokens = extra_int(ctx, "context_tokens", 0, 0, 4096)
        self.chat_template = extra_bool(ctx, "chat_template", False)
        self.request_sampling = extra_bool(ctx, "request_sampling", True)
        cache = ctx.config.engine_extras.get("model_cache")
        if cache is not None and not isinstance(cache, str):
            raise EngineConfigError(
                f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.model_cache "
                "must be a folder path"
            )
        self.cache_dir = Path(cache) if cache else default_cache_dir()
        self.text_final = ctx.stage.final_output is OutputKind.TEXT
        self.hands_on = bool(ctx.pipeline.downstream(ctx.stage.stage_id))
        self._llm: Any = None
        self._tokenizer: Any = None
        self._segments: WorkerSegments | None = None  # a CPU multi-worker engine's (cpu_binding)
        self._streams: dict[str, VllmStream] = {}
        self._serial = 0
        self._tokens = 0  # generated since the last stats report
        self.kv_counts = KvTransferCounts()  # a split stage's transfers
        self._stats_t = time.monotonic()

    # ---- lifecycle -----------------------------------------------------------------------

    def engine_args(self) -> dict[str, Any]:
        """vLLM's engine arguments for this stage (a subclass adds its own)."""
        return build_engine_args(self.ctx.config, self.cache_dir)

    def loaded(self, args: dict[str, Any]) -> None:
        """Called once vLLM's engine is up (a subclass hooks into it here)."""

    def load(self) -> None:
        args = self.engine_args()
        if self.ctx.config.prefill is not None:
            lease_s = extra_int(self.ctx, "kv_lease_s", 30, 1, 3600)
            args = with_kv_connector(args, lease_s)
            from vllm.platforms import current_platform

            cpu = current_platform.device_type == "cpu"
            default_delay = CPU_PROGRESS_DELAY_US if cpu else 0
            delay = extra_int(self.ctx, "nixl_progress_delay_us", default_delay, 0, 1_000_000)
            pace_nixl_progress(delay)
        if self.ctx.config.world_size == 1:
            # vLLM reads this to choose its executor (on CPU: the in-process one only when it
            # is "0"); one replica is one process, whatever the environment says.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            where = f"stage {self.ctx.stage.name!r} ({self.ctx.pipeline.name})"
            bind_cpu_workers(self.ctx.config.world_size, where)
            self._segments = WorkerSegments()
        vllm_config = make_vllm_config(args, self.ctx.stage.stage_id)
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        # In-process engine core whatever VLLM_ENABLE_V1_MULTIPROCESSING says: one process.
        self._llm = LLMEngine(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=False,
            multiprocess_mode=False,
        )
        if self._segments is not None:
            self._segments.started()
        self._tokenizer = None if args.get("skip_tokenizer_init") else self._llm.get_tokenizer()
        if self.ctx.config.prefill is not None:
            self.kv_counts.install()
        self.loaded(args)
        logger.info(
            "vLLM engine ready stage=%d model=%s max_num_seqs=%d",
            self.ctx.stage.stage_id,
            args["model"],
            self.ctx.config.max_num_seqs,
        )

    def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.close()
        if self._llm is not None:
            self._llm.engine_core.shutdown()  # vLLM's executor and its distributed state
        self._llm = None
        if self._segments is not None:
            self._segments.unlink()

    # ---- the core's protocol -------------------------------------------------------------

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        """Whole answers for a batch (outside the core): step vLLM until every one finished."""
        streams = self.open(batch)
        results: list[EngineResult] = []
        for stream in streams:
            while True:
                self.before_step(len(streams))
                result = next(stream)
                if result is not None and result.last:
                    results.append(result)
                    break
        return results

    def open(self, batch: Sequence[EngineRequest]) -> list[Iterator[EngineResult | None]]:
        opened: list[Iterator[EngineResult | None]] = []
        for request in batch:
            try:
                opened.append(self._add(request))
            except EngineInputError as exc:
                opened.append(iter([EngineResult(request.request_id, error=str(exc))]))
        return opened

    def before_step(self, streams: int) -> None:
        """One vLLM step; its outputs go to their streams."""
        if not self._llm.has_unfinished_requests():
            return
        for out in self._llm.step():
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._tokens += stream.feed(out)
            if stream.finished:
                del self._streams[out.request_id]

    def idle(self) -> None:
        """A split stage's prefill engine keeps finished requests' KV for the decode replicas
        to pull; vLLM frees it (pulled, or its lease ran out) only inside a step, so an idle
        engine steps while it holds any."""
        if self._llm is None or self.ctx.config.prefill is None:
            return
        if self._llm.engine_core.engine_core.scheduler.has_finished_requests():
            self._llm.step()

    def stats(self) -> EngineStats | None:
        if self._llm is None:
            return None
        scheduler = self._llm.engine_core.engine_core.scheduler
        running, waiting = scheduler.get_request_counts()
        now = time.monotonic()
        rate = self._tokens / max(1e-6, now - self._stats_t)
        self._tokens, self._stats_t = 0, now
        kv = self.kv_counts
        split = self.ctx.config.prefill is not None
        return EngineStats(
            running=int(running),
            waiting=int(waiting),
            kv_cache_usage=float(scheduler.get_kv_cache_usage()),
            tokens_per_s=rate,
            kv_pulled=kv.pulled,
            kv_pulled_bytes=kv.pulled_bytes,
            kv_pulled_s=kv.pulled_s,
            kv_pull_failed=kv.failed,
            kv_expired=kv.expired,
            prefill_tokens_queued=queued_prefill_tokens(scheduler) if split else 0,
        )

    # ---- requests ------------------------------------------------------------------------

    def _add(self, request: EngineRequest) -> VllmStream:
        from vllm.sampling_params import RequestOutputKind

        prompt = self._prompt(request)
        params = self._sampling(request)
        params.output_kind = RequestOutputKind.DELTA
        prefill = is_prefill(request.kv_transfer)
        local = self._kv_part(request, request.kv_transfer, params)
        vid = self._submit(request, prompt, params)
        stream = VllmStream(
            engine=self,
            vid=vid,
            request=request,
            streaming=self.ctx.async_chunk and request.whole and not prefill,
            chunk_tokens=self.chunk_tokens,
            first_chunk_tokens=self.first_chunk_tokens,
            context_tokens=self.context_tokens,
            text_final=self.text_final,
            fields=pass_fields(request.data),
            hands_on=self.hands_on,
        )
        if local is not None:
            stream.local_retry = (prompt, local)
        self._streams[vid] = stream
        return stream

    def _kv_part(self, request: EngineRequest, kv_transfer: str, params: Any) -> Any:
        """Set a split stage's part on vLLM sampling ``params`` from ``kv_transfer``: a
        prefill keeps the prompt's KV for the decode replica (one token); a decode pulls the
        KV the prefill replica computed. For a decode, ``params`` without the pull (what a
        failed pull runs again, prefilled here); else None. Params a decode cannot use leave it
        to prefill here at once (counted failed)."""
        if is_prefill(kv_transfer):
            params.max_tokens = 1
            params.extra_args = {"kv_transfer_params": prefill_params()}
            return None
        if not kv_transfer:
            return None
        try:
            pulled = decode_params(kv_transfer)
        except KvTransferError as exc:  # nothing to pull from: prefill here instead
            self.kv_counts.failed += 1
            logger.warning("stage=%d id=%s: %s", self.ctx.stage.stage_id, request.request_id, exc)
            return None
        local = params.clone()
        params.extra_args = {"kv_transfer_params": pulled}
        return local

    def _submit(self, request: EngineRequest, prompt: Any, params: Any) -> str:
        """Add one request to vLLM under a fresh id; that id."""
        from vllm.exceptions import VLLMClientError

        self._serial += 1
        vid = f"{request.request_id}/{request.chunk}#{self._serial}"
        try:
            self._llm.add_request(vid, prompt, params)
        except (ValueError, VLLMClientError) as exc:  # vLLM's input checks (too long, bad id…)
            raise EngineInputError(
                f"stage {self.ctx.stage.stage_id}: {' '.join(str(exc).split())}"
            ) from None
        return vid

    def prefill_locally(self, stream: VllmStream) -> None:
        """A decode request whose KV pull failed (vLLM failed it before its first token: the
        prefill replica died, or its lease ran out): the same request again, prefilled here,
        so the answer is the one a pull would have given. Counted as a failed pull."""
        assert stream.local_retry is not None
        prompt, params = stream.local_retry
        stream.local_retry = None
        self._streams.pop(stream.vid, None)
        self.kv_counts.failed += 1
        stream.vid = self._submit(stream.request, prompt, params)
        self._streams[stream.vid] = stream
        logger.warning(
            "KV pull failed stage=%d id=%s: prefilling here",
            self.ctx.stage.stage_id,
            stream.request_id,
        )

    def abort(self, vid: str) -> None:
        """Abort ``vid`` inside vLLM now (frees its KV blocks); called by a closed stream."""
        if self._streams.pop(vid, None) is not None and self._llm is not None:
            self._llm.abort_request([vid])
            logger.info("vLLM request aborted stage=%d id=%s", self.ctx.stage.stage_id, vid)

    def decode(self, ids: list[int]) -> str:
        """Token ids as text ("" without a tokenizer)."""
        if self._tokenizer is None:
            return ""
        return str(self._tokenizer.decode(ids))

    def _prompt(self, request: EngineRequest) -> Any:
        ids = request.data.arrays.get("token_ids")
        if ids is not None:
            if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
                raise EngineInputError(
                    f"stage {self.ctx.stage.stage_id}: token_ids must be a non-empty 1-D "
                    f"integer array, got {ids.dtype}{list(ids.shape)}"
                )
            return {"prompt_token_ids": [int(t) for t in ids]}
        text = request.data.fields.get("prompt")
        if not isinstance(text, str) or not text:
            raise EngineInputError(
                f"stage {self.ctx.stage.stage_id}: input needs a 'prompt' string or a "
                "'token_ids' array"
            )
        raw = request.data.fields.get("chat_template") is False  # /v1/completions: as given
        if self.chat_template and self._tokenizer is not None and not raw:
            ids_list = self._tokenizer.apply_chat_template(
                self._messages(request, text), tokenize=True, add_generation_prompt=True
            )
            if not isinstance(ids_list, list):  # BatchEncoding in newer transformers
                ids_list = list(ids_list["input_ids"])
            return {"prompt_token_ids": [int(t) for t in ids_list]}
        return {"prompt": text}

    def _messages(self, request: EngineRequest, text: str) -> list[dict[str, str]]:
        """The conversation to template: field ``messages`` (JSON text, a list of
        ``{"role", "content"}`` strings, from the chat route), else ``prompt`` as one user
        message."""
        raw = request.data.fields.get("messages")
        if raw is None:
            return [{"role": "user", "content": text}]
        try:
            messages = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            messages = None
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise EngineInputError(
                f"stage {self.ctx.stage.stage_id}: field 'messages' must be JSON text of a "
                'non-empty list of {"role": str, "content": str}'
            )
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    def _sampling(self, request: EngineRequest) -> Any:
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import SamplingParams

        d = self.ctx.config.sampling
        values: dict[str, Any] = {
            "temperature": d.temperature,
            "top_p": d.top_p,
            "top_k": d.top_k,
            "max_tokens": d.max_tokens,
            "repetition_penalty": d.repetition_penalty,
            "stop": list(d.stop) or None,
        }
        s = request.sampling if self.request_sampling else None
        if s is not None:  # field by field: unset (None) keeps the stage's default
            for key in REQUEST_SAMPLING_FIELDS:
                if getattr(s, key) is not None:
                    values[key] = getattr(s, key)
        cap = request.data.fields.get("max_tokens")
        if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
            values["max_tokens"] = cap
        values.setdefault("max_tokens", None)
        values["max_tokens"] = values["max_tokens"] or DEFAULT_MAX_TOKENS
        if values.get("top_k") == 0:
            values["top_k"] = None  # ours: 0 = off; vLLM: -1 or None = off
        if self._tokenizer is None:  # skip_tokenizer_init: token ids only, no text
            values["detokenize"] = False
        if request.data.fields.get("echo") is True and values.get("logprobs") is not None:
            values["prompt_logprobs"] = values["logprobs"]  # echo: the prompt's too
        clean = {k: v for k, v in values.items() if v is not None}
        try:
            return SamplingParams(seed=(request.seed + request.chunk) % (1 << 63), **clean)
        except (ValueError, VLLMClientError) as exc:
            raise EngineInputError(
                f"stage {self.ctx.stage.stage_id}: sampling params: {' '.join(str(exc).split())}"
            ) from None
