"""VllmStream: the core's view of one request inside vLLM (see ``engine.py``).

The engine feeds it each vLLM step's delta (``feed``); the core pulls results with ``next()``:
``None`` while there is nothing to emit, a chunk when streaming and enough tokens wait (the
first as soon as one exists, then every ``chunk_tokens``), the last result when vLLM finished.
``close()`` before the end aborts the request inside vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import EngineRequest, EngineResult, StageData

if TYPE_CHECKING:
    from omni_mesh.engines.vllm.engine import VllmEngine

#: Input fields consumed by the engine itself (everything else passes through to ``output``).
CONSUMED_FIELDS = frozenset({"prompt", "max_tokens", "messages", "echo"})


def pass_fields(data: StageData) -> dict[str, Scalar]:
    """The input fields carried on to the stage's output (``voice``, ``seed``…)."""
    return {k: v for k, v in data.fields.items() if k not in CONSUMED_FIELDS}


class VllmStream:
    """An iterator of :class:`EngineResult` (or ``None``: nothing this step) for one request."""

    def __init__(
        self,
        *,
        engine: VllmEngine,
        vid: str,
        request: EngineRequest,
        streaming: bool,
        chunk_tokens: int,
        first_chunk_tokens: int,
        context_tokens: int,
        text_final: bool,
        fields: dict[str, Scalar],
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
        self.want_logprobs = request.sampling is not None and request.sampling.logprobs is not None
        self.finished = False  # vLLM finished the request (its last tokens may still wait here)
        self.done = False  # the last result was handed out, or the stream was closed
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.generated = 0
        self.chunks = 0
        self._ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[float] = []
        self._history: list[int] = []  # tokens already handed out (left context)

    def feed(self, out: Any) -> int:
        """Take one vLLM ``RequestOutput`` (a delta); the number of new tokens."""
        completion = out.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        self._ids += ids
        self._text.append(completion.text or "")
        if self.want_logprobs and completion.logprobs:
            for tid, entry in zip(ids, completion.logprobs, strict=False):
                self._logprobs.append(float(entry[tid].logprob))
        if out.prompt_token_ids is not None:
            self.prompt_tokens = len(out.prompt_token_ids)
        self.generated += len(ids)
        if out.finished:
            self.finished = True
            self.finish_reason = completion.finish_reason
        return len(ids)

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

    def _result(self, *, last: bool) -> EngineResult:
        text = "".join(self._text)
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
        usage: dict[str, Scalar] = {}
        if last:
            usage = {
                "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.generated,
            }
        self._history += self._ids
        self._ids, self._text, self._logprobs = [], [], []
        self.chunks += 1
        final = None
        if self.text_final:  # the client's part: text (+ the sampled tokens' logprobs)
            lp = {"logprobs": arrays["logprobs"]} if self.want_logprobs else {}
            final = StageData(fields={"text": text, **usage}, arrays=lp)
        return EngineResult(
            self.request_id,
            output=StageData(fields={**fields, **usage}, arrays=arrays),
            final=final,
            last=last,
        )
