"""One request of the vLLM thinker (``vllm_thinker.py``): its tokens from vLLM's outputs, its
tapped rows by position, and its results in the transformers thinker's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.vllm.stream import StreamOwner, VllmStream


@dataclass(frozen=True)
class ThinkerTexts:
    """What every stream of one engine shares: its tokenizer, ``<|im_end|>`` and the input
    embeddings of tts_bos, tts_eos, tts_pad (float32 [3, D])."""

    tokenizer: Any
    im_end: int
    tts_special: np.ndarray


class ThinkerStream(VllmStream):
    """A thinker request inside vLLM: text deltas for the client while it runs (when
    streaming), then the whole output for the talker (module docstring of ``vllm_thinker``)."""

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
        self.voice = voice
        self.audio_lengths = audio_lengths
        self.prompt_ids: list[int] = []
        self.answer: list[int] = []  # every generated token
        self.sent_text = ""  # the text the client has been sent
        self.rows = np.zeros((2, 0, texts.tts_special.shape[1]), np.float32)  # embed, hidden
        self.have = np.zeros(0, bool)  # positions whose rows arrived

    def take_rows(self, first: int, rows: Any) -> None:
        """One step's rows of this request, positions ``first…`` (a recomputed position, after a
        preemption, writes the same values again)."""
        n = int(rows.shape[1])
        end = first + n
        if end > self.rows.shape[1]:
            grown = max(end, 2 * self.rows.shape[1], 64)
            rows_now, have_now = self.rows, self.have
            self.rows = np.zeros((2, grown, rows_now.shape[2]), np.float32)
            self.have = np.zeros(grown, bool)
            self.rows[:, : rows_now.shape[1]] = rows_now
            self.have[: have_now.shape[0]] = have_now
        self.rows[:, first:end] = rows.float().numpy()
        self.have[first:end] = True

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
        return self._whole()

    def _text_delta(self) -> EngineResult | None:
        """The text the client has not seen, for it alone; None while no new text is stable
        (a token may end inside a UTF-8 character)."""
        text = self._stable_text(self.answer)
        if len(text) <= len(self.sent_text):
            return None
        delta = StageData(fields={"text": text[len(self.sent_text) :]})
        self.sent_text = text
        return EngineResult(self.request_id, final=delta, last=False, forward=False)

    def _stable_text(self, tokens: list[int]) -> str:
        if not tokens:
            return ""
        text = self.texts.tokenizer.decode(tokens, skip_special_tokens=True)
        return str(text).rstrip("\ufffd")

    def _whole(self) -> EngineResult:
        prompt, answer = len(self.prompt_ids), len(self.answer)
        ran = prompt + answer - 1  # the last token was never fed back
        if ran <= 0 or self.have.shape[0] < ran or not self.have[:ran].all():
            missing = int(ran - self.have[:ran].sum()) if ran > 0 else 0
            return EngineResult(
                self.request_id,
                error=f"vLLM thinker: {missing} of {ran} positions' hidden states never came "
                "(prefix caching or a step without its rows)",
            )
        text = str(self.texts.tokenizer.decode(self.answer, skip_special_tokens=True))
        arrays: dict[str, np.ndarray] = {
            "sequences": np.asarray(self.prompt_ids + self.answer, dtype=np.int64),
            "thinker_embed": self.rows[0, :ran].copy(),
            "thinker_hidden": self.rows[1, :ran].copy(),
            "tts_special": self.texts.tts_special,
        }
        if self.audio_lengths is not None:
            arrays["audio_feature_lengths"] = self.audio_lengths
        fields: dict[str, Scalar] = {
            "text": text,
            "voice": self.voice,
            "prompt_tokens": prompt,
            "generated_tokens": answer,
        }
        if not text.startswith(self.sent_text):  # a decode that changed its past
            self.sent_text = ""
        final = StageData(
            fields={
                "text": text[len(self.sent_text) :],
                "finish_reason": "stop" if self.answer[-1] == self.texts.im_end else "length",
                "prompt_tokens": prompt,
                "completion_tokens": answer,
            }
        )
        return EngineResult(
            self.request_id, output=StageData(fields=fields, arrays=arrays), final=final
        )
