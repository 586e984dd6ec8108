"""One request of the vLLM thinker (``vllm_thinker.py``): its tokens from vLLM's outputs, its
tapped rows by position, and its results in the transformers thinker's shape."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_mesh.data_plane.kv_transfer import KvTransferError
from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.kv.pull import KvPull
from omni_mesh.engines.qwen3_omni.answer import (
    AnswerChunks,
    TextDeltas,
    no_text,
    thinker_answer,
)
from omni_mesh.engines.vllm.stream import StreamOwner, VllmStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThinkerTexts:
    """What every stream of one engine shares: its tokenizer, ``<|im_end|>`` and the input
    embeddings of tts_bos, tts_eos, tts_pad (float32 [3, D])."""

    tokenizer: Any
    im_end: int
    tts_special: np.ndarray


class ThinkerStream(VllmStream):
    """A thinker request inside vLLM: text deltas for the client while it runs (when
    streaming), then the whole output for the talker (module docstring of ``vllm_thinker``).

    A split stage's prefill request (``hold``: the engine's ``PromptRows.hold``) answers with
    the params of its KV and prompt rows instead; a decode request hands out nothing while its
    prompt rows are read (``pulling``), see ``vllm_thinker_split``."""

    def __init__(
        self,
        *,
        engine: StreamOwner,
        vid: str,
        request: EngineRequest,
        streaming: bool,
        chunk_tokens: int,
        texts: ThinkerTexts,
        voice: str,
        audio_lengths: np.ndarray | None,
        handoff: AnswerChunks | None = None,
        hold: Callable[[str, np.ndarray], str] | None = None,
    ) -> None:
        super().__init__(
            engine=engine,
            vid=vid,
            request=request,
            streaming=streaming,
            chunk_tokens=chunk_tokens,
            first_chunk_tokens=chunk_tokens,
            context_tokens=0,
            text_final=True,
            fields={},
        )
        self.texts = texts
        self.handoff = handoff  # the answer handed on as it is made (a streamed input)
        self.voice = voice
        self.audio_lengths = audio_lengths
        self.prompt_ids: list[int] = []
        self.answer: list[int] = []  # every generated token
        self.text = TextDeltas(texts.tokenizer)  # the text the client has been sent
        self.rows = np.zeros((2, 0, texts.tts_special.shape[1]), np.float32)  # embed, hidden
        self.have = np.zeros(0, bool)  # positions whose rows arrived
        self.hold = hold  # a prefill request's: holds the prompt rows, gives the params
        self.pulling: KvPull | None = None  # a decode request's read of its prompt rows
        self.pulled = 0  # the prompt rows the read brought

    def take_rows(self, first: int, rows: Any) -> None:
        """One step's rows of this request, positions ``first…`` (a recomputed position, after a
        preemption, writes the same values again)."""
        end = first + int(rows.shape[1])
        self._grow(end)
        self.rows[:, first:end] = rows.float().numpy()
        self.have[first:end] = True

    def take_pulled(self, rows: np.ndarray) -> None:
        """A decode's prompt rows, float32 [2, P, D], read from the prefill replica: they fill
        the positions this engine did not compute itself."""
        n = int(rows.shape[1])
        self._grow(n)
        missing = ~self.have[:n]
        self.rows[:, :n][:, missing] = rows[:, missing]
        self.have[:n] = True
        self.pulled = n
        self.pulling = None

    def _grow(self, end: int) -> None:
        if end <= self.rows.shape[1]:
            return
        grown = max(end, 2 * self.rows.shape[1], 64)
        rows_now, have_now = self.rows, self.have
        self.rows = np.zeros((2, grown, rows_now.shape[2]), np.float32)
        self.have = np.zeros(grown, bool)
        self.rows[:, : rows_now.shape[1]] = rows_now
        self.have[: have_now.shape[0]] = have_now

    def restart(self) -> None:
        """Forget what vLLM gave so far: the request runs again, prefilled here (a failed KV
        or rows pull; nothing was handed out yet)."""
        if self.pulling is not None:
            self.pulling.cancel()
            self.pulling = None
        self.prompt_ids, self.answer, self.pulled = [], [], 0
        self.text = TextDeltas(self.texts.tokenizer)
        self.rows = np.zeros((2, 0, self.rows.shape[2]), np.float32)
        self.have = np.zeros(0, bool)
        self._ids, self._text, self._history, self.generated = [], [], [], 0

    def __next__(self) -> EngineResult | None:
        if self.pulling is not None and not self.done:
            return None  # the prompt rows are still on their way
        return super().__next__()

    def close(self) -> None:
        if self.pulling is not None:
            self.pulling.cancel()
            self.pulling = None
        super().close()

    def feed(self, out: Any) -> int:
        if not self.prompt_ids and out.prompt_token_ids is not None:
            self.prompt_ids = [int(t) for t in out.prompt_token_ids]
        new = super().feed(out)
        if new:
            self.answer += [int(t) for t in out.outputs[0].token_ids]
        return new

    def _result(self, *, last: bool) -> EngineResult | None:
        self._ids = []  # the chunk count restarts (VllmStream.__next__)
        if not last:
            return self._text_delta()
        if self.hold is not None:
            return self._held()
        result = self._whole()
        if self.handoff is not None and result.error is None:
            result.output = self.handoff.last(result.output)
        return result

    def _text_delta(self) -> EngineResult | None:
        """The text the client has not seen (None while no new text is stable: a token may
        end inside a UTF-8 character), with the answer's next chunk for the talker when one is
        due (``AnswerChunks``); for the client alone without one."""
        new = self.text.delta(self.answer)
        delta = StageData(fields={"text": new}) if new else None
        handed = self._handoff()
        if handed is not None:
            return EngineResult(
                self.request_id, output=handed, final=delta or no_text(), last=False
            )
        if delta is None:
            return None
        return EngineResult(self.request_id, final=delta, last=False, forward=False)

    def _handoff(self) -> StageData | None:
        """The answer's next chunk for the talker: the rows from the last chunk's end up to
        the first position whose rows have not come (at most every position ran)."""
        handoff = self.handoff
        if handoff is None or not self.prompt_ids:
            return None
        ran = len(self.prompt_ids) + len(self.answer) - 1
        missing = np.flatnonzero(~self.have[:ran])
        rows = int(missing[0]) if missing.size else min(ran, int(self.have.shape[0]))
        if not handoff.due(len(self.prompt_ids), rows):
            return None
        start = handoff.rows_sent
        return handoff.chunk(
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int64),
            answer=self.answer,
            embeds=self.rows[0, start:rows].copy(),
            hidden=self.rows[1, start:rows].copy(),
            tts_special=self.texts.tts_special,
            audio_lengths=self.audio_lengths,
            voice=self.voice,
        )

    def _held(self) -> EngineResult:
        """A prefill's answer: the params of its KV (vLLM's) and of its prompt rows."""
        assert self.hold is not None
        prompt = len(self.prompt_ids)
        if not prompt or self.have.shape[0] < prompt or not self.have[:prompt].all():
            return EngineResult(self.request_id, error="vLLM thinker: the prompt's rows never came")
        try:
            params = self.hold(self.kv_transfer, self.rows[:, :prompt])
        except KvTransferError as exc:
            return EngineResult(self.request_id, error=f"vLLM thinker prefill: {exc}")
        return EngineResult(self.request_id, kv_transfer=params)

    def _whole(self) -> EngineResult:
        prompt, answer = len(self.prompt_ids), len(self.answer)
        if self.pulled and self.pulled != prompt:
            return EngineResult(
                self.request_id,
                error=f"vLLM thinker: the prefill replica sent {self.pulled} prompt rows for a "
                f"prompt of {prompt} tokens",
            )
        ran = prompt + answer - 1  # the last token was never fed back
        if ran <= 0 or self.have.shape[0] < ran or not self.have[:ran].all():
            missing = int(ran - self.have[:ran].sum()) if ran > 0 else 0
            return EngineResult(
                self.request_id,
                error=f"vLLM thinker: {missing} of {ran} positions' hidden states never came "
                "(prefix caching or a step without its rows)",
            )
        output, final = thinker_answer(
            tokenizer=self.texts.tokenizer,
            im_end=self.texts.im_end,
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int64),
            answer=self.answer,
            embeds=self.rows[0, :ran].copy(),
            hidden=self.rows[1, :ran].copy(),
            tts_special=self.texts.tts_special,
            audio_lengths=self.audio_lengths,
            voice=self.voice,
        )
        text = str(final.fields["text"])
        sent = self.text.sent
        if not text.startswith(sent):  # a decode that changed its past: should not happen
            logger.warning("streamed text is not a prefix request_id=%s", self.request_id)
        final.fields["text"] = text[len(sent) :]
        return EngineResult(self.request_id, output=output, final=final)
