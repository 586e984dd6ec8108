"""VllmStream: the core's view of one request inside vLLM (see ``engine.py``).

The engine feeds it each vLLM step's delta (``feed``); the core pulls results with ``next()``:
``None`` while there is nothing to emit, a chunk when streaming and enough tokens wait (the
first as soon as one exists, then every ``chunk_tokens``), the last result when vLLM finished.
``close()`` before the end aborts the request inside vLLM.

Logprobs (the request's ``logprobs`` k set), on a text stage's ``final`` data: per sampled token
vLLM gives a dict of alternatives, the sampled token first, then the top k (the sampled one not
repeated): array ``logprobs`` (float32 [T], the sampled tokens'), array ``top_logprobs``
(float32 [T, W], each row the dict's logprobs in vLLM's order, NaN-padded) and field
``logprob_tokens`` (JSON text, a list per token of the dict's decoded token strings). With field
``echo`` true, the first result also carries ``prompt_text`` (the prompt, detokenized) and, when
logprobs are asked, the prompt's as ``prompt_logprobs`` / ``prompt_top_logprobs`` /
``prompt_logprob_tokens`` (position 0 has none: NaN, and only its own token).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import EngineRequest, EngineResult, StageData


class StreamOwner(Protocol):
    """What a stream needs of its engine (:class:`~.engine.VllmEngine`)."""

    def prefill_locally(self, stream: VllmStream) -> None:
        """Run the stream's request again, prefilled here (its KV pull failed)."""

    def abort(self, vid: str) -> None:
        """Abort vLLM request ``vid`` now."""

    def decode(self, ids: list[int]) -> str:
        """Token ids as text."""


#: Input fields consumed by the engine itself (everything else passes through to ``output``).
CONSUMED_FIELDS = frozenset({"prompt", "max_tokens", "messages", "echo", "chat_template"})


def pass_fields(data: StageData) -> dict[str, Scalar]:
    """The input fields carried on to the stage's output (``voice``, ``seed``…)."""
    return {k: v for k, v in data.fields.items() if k not in CONSUMED_FIELDS}


class VllmStream:
    """An iterator of :class:`EngineResult` (or ``None``: nothing this step) for one request."""

    def __init__(
        self,
        *,
        engine: StreamOwner,
        vid: str,
        request: EngineRequest,
        streaming: bool,
        chunk_tokens: int,
        first_chunk_tokens: int,
        context_tokens: int,
        text_final: bool,
        fields: dict[str, Scalar],
        hands_on: bool = True,
    ) -> None:
        self.engine = engine
        self.vid = vid
        self.request_id = request.request_id
        self.streaming = streaming
        self.chunk_tokens = chunk_tokens
        self.first_chunk_tokens = first_chunk_tokens
        self.context_tokens = context_tokens
        self.text_final = text_final
        self.fields = fields
        self.hands_on = hands_on  # a next stage reads the output (else only the client's part)
        self.want_logprobs = request.sampling is not None and request.sampling.logprobs is not None
        self.echo = request.data.fields.get("echo") is True
        self._prompt_final: dict[str, Any] | None = None  # echo: for the first final result
        self.finished = False  # vLLM finished the request (its last tokens may still wait here)
        self.done = False  # the last result was handed out, or the stream was closed
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.generated = 0
        self.chunks = 0
        self._ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[float] = []
        self._top: list[list[float]] = []
        self._top_tokens: list[list[str]] = []
        self._history: list[int] = []  # tokens already handed out (left context)
        self.kv_transfer = ""  # a prefill request's answer: vLLM's params of its KV blocks
        self.request = request
        # A decode request's (prompt, sampling params) without the pull, for a failed pull.
        self.local_retry: tuple[Any, Any] | None = None

    def feed(self, out: Any) -> int:
        """Take one vLLM ``RequestOutput`` (a delta); the number of new tokens."""
        completion = out.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        self._ids += ids
        self._text.append(completion.text or "")
        if self.want_logprobs and completion.logprobs:
            for tid, entry in zip(ids, completion.logprobs, strict=False):
                self._logprobs.append(float(entry[tid].logprob))
                self._top.append([float(lp.logprob) for lp in entry.values()])
                self._top_tokens.append([lp.decoded_token or "" for lp in entry.values()])
        if out.prompt_token_ids is not None:
            self.prompt_tokens = len(out.prompt_token_ids)
            if self.echo and self._prompt_final is None:
                self._prompt_final = self._prompt_part(out)
        self.generated += len(ids)
        if out.finished and self._pull_failed(completion.finish_reason):
            self.engine.prefill_locally(self)
            return 0
        if out.finished:
            self.finished = True
            self.finish_reason = completion.finish_reason
            params = getattr(out, "kv_transfer_params", None)
            if params:
                self.kv_transfer = json.dumps(params, separators=(",", ":"))
        return len(ids)

    def _pull_failed(self, finish_reason: str | None) -> bool:
        """vLLM ended a decode request with an error before its first token: its KV load
        failed (``kv_load_failure_policy: fail``)."""
        return self.local_retry is not None and finish_reason == "error" and not self.generated

    def __iter__(self) -> VllmStream:
        return self

    def __next__(self) -> EngineResult | None:
        if self.done:
            raise StopIteration
        if self.finished:
            self.done = True
            return self._result(last=True)
        need = self.first_chunk_tokens if self.chunks == 0 else self.chunk_tokens
        if self.streaming and len(self._ids) >= need:
            return self._result(last=False)
        return None

    def close(self) -> None:
        """The core is done with this stream: abort it in vLLM unless it finished there."""
        if not self.done:
            self.done = True
            if not self.finished:
                self.engine.abort(self.vid)

    def _prompt_part(self, out: Any) -> dict[str, Any]:
        """Echo: the prompt's text and (when asked) logprobs, for the first final result."""
        ids = [int(t) for t in out.prompt_token_ids]
        decode = self.engine.decode
        text = out.prompt if isinstance(out.prompt, str) else decode(ids)
        part: dict[str, Any] = {"fields": {"prompt_text": text}, "arrays": {}}
        if not self.want_logprobs or out.prompt_logprobs is None or not ids:
            return part
        logprobs, top, tokens = [float("nan")], [[float("nan")]], [[decode(ids[:1])]]
        for tid, entry in zip(ids[1:], list(out.prompt_logprobs)[1:], strict=False):
            logprobs.append(float(entry[tid].logprob))
            top.append([float(lp.logprob) for lp in entry.values()])
            tokens.append([lp.decoded_token or "" for lp in entry.values()])
        part["fields"]["prompt_logprob_tokens"] = json.dumps(tokens, ensure_ascii=False)
        part["arrays"]["prompt_logprobs"] = np.asarray(logprobs, dtype=np.float32)
        part["arrays"]["prompt_top_logprobs"] = _padded(top)
        return part

    def _final(self, text: str, usage: dict[str, Scalar]) -> StageData:
        """The client's part: text, usage on the last, logprobs when asked, echo on the first."""
        fields: dict[str, Scalar] = {"text": text, **usage}
        arrays: dict[str, np.ndarray] = {}
        if self.want_logprobs:
            arrays["logprobs"] = np.asarray(self._logprobs, dtype=np.float32)
            arrays["top_logprobs"] = _padded(self._top)
            fields["logprob_tokens"] = json.dumps(self._top_tokens, ensure_ascii=False)
        if self.chunks == 0 and self._prompt_final is not None:
            fields.update(self._prompt_final["fields"])
            arrays.update(self._prompt_final["arrays"])
        return StageData(fields=fields, arrays=arrays)

    def _result(self, *, last: bool) -> EngineResult | None:
        """The next result (None: nothing to hand out yet, for a subclass that decides)."""
        text = "".join(self._text)
        output = StageData()  # no next stage: the client's part alone (the per-token path)
        if self.hands_on:
            arrays = {"token_ids": np.asarray(self._ids, dtype=np.int64)}
            if self.context_tokens and self._history:
                context = self._history[-self.context_tokens :]
                arrays["context_token_ids"] = np.asarray(context, dtype=np.int64)
            if self.want_logprobs:
                arrays["logprobs"] = np.asarray(self._logprobs, dtype=np.float32)
            fields: dict[str, Scalar] = {
                **self.fields,
                "text": text,
                "generated_tokens": self.generated,
            }
            output = StageData(fields=fields, arrays=arrays)
        usage: dict[str, Scalar] = {}
        if last:
            usage = {
                "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.generated,
            }
            if self.hands_on:
                output.fields.update(usage)
        final = self._final(text, usage) if self.text_final else None
        self._history += self._ids
        self._ids, self._text, self._logprobs, self._top, self._top_tokens = [], [], [], [], []
        self.chunks += 1
        return EngineResult(
            self.request_id,
            output=output,
            final=final,
            last=last,
            kv_transfer=self.kv_transfer if last else "",
        )


def _padded(rows: list[list[float]]) -> np.ndarray:
    """Rows of varying length as one float32 [len(rows), widest] array, NaN-padded."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), np.nan, dtype=np.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
