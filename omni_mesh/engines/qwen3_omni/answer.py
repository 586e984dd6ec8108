"""The thinker's answer in the shape the talker and the client read, whichever engine made it
(``thinker.py`` on transformers, ``vllm_thinker.py`` on vLLM): one definition, so the two hand
on the same arrays and fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import EngineContext, StageData
from omni_mesh.engines.extras import extra_int


class TextDeltas:
    """The client's text of a growing answer, a delta at a time (special tokens dropped). Each
    call decodes only the tokens since the last delta, after those of the delta before them as
    context (as vLLM's incremental detokenizer does: a SentencePiece word's leading space, a
    cleanup across the boundary), not the whole answer: a step costs the same at token 1,000 as
    at token 1. A token that ends inside a UTF-8 character waits for the rest of it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sent = ""  # every delta so far, joined
        self._context = 0  # the first token of the window decoded: the last delta's first
        self._done = 0  # tokens whose text was handed out

    def delta(self, tokens: Sequence[int]) -> str:
        """The text ``tokens`` (the whole answer so far) add to what was handed out ("" while
        none is complete)."""
        if len(tokens) <= self._done:
            return ""
        known = self._decode(tokens[self._context : self._done])
        text = self._decode(tokens[self._context :])
        if len(text) <= len(known) or text.endswith("\ufffd") or not text.startswith(known):
            return ""
        delta = text[len(known) :]
        self._context, self._done = self._done, len(tokens)
        self.sent += delta
        return delta

    def _decode(self, tokens: Sequence[int]) -> str:
        if not tokens:
            return ""
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))


def no_text() -> StageData:
    """A client chunk with no new text: every result of a stream is a chunk of the client's
    answer (the API server assembles them by index), a chunk for the talker alone too."""
    return StageData(fields={"text": ""})


def thinker_answer(
    *,
    tokenizer: Any,
    im_end: int,
    prompt_ids: np.ndarray,
    answer: Sequence[int],
    embeds: np.ndarray,
    hidden: np.ndarray,
    tts_special: np.ndarray,
    audio_lengths: np.ndarray | None,
    voice: str,
) -> tuple[StageData, StageData]:
    """(output for the talker, final for the client) of one answer: arrays ``sequences`` int64
    [P+N], ``thinker_embed`` and ``thinker_hidden`` float32 [P+N-1, D], ``tts_special`` [3, D],
    ``audio_feature_lengths`` with audio; the text, ``finish_reason`` and usage."""
    prompt, generated = int(prompt_ids.shape[0]), len(answer)
    text = str(tokenizer.decode(list(answer), skip_special_tokens=True))
    arrays = {
        "sequences": np.concatenate([prompt_ids, np.asarray(answer)]).astype(np.int64),
        "thinker_embed": embeds,
        "thinker_hidden": hidden,
        "tts_special": tts_special,
    }
    if audio_lengths is not None:
        arrays["audio_feature_lengths"] = audio_lengths.astype(np.int64)
    fields: dict[str, Scalar] = {
        "text": text,
        "voice": voice,
        "prompt_tokens": prompt,
        "generated_tokens": generated,
    }
    final = StageData(
        fields={
            "text": text,
            "finish_reason": "stop" if answer[-1] == im_end else "length",
            "prompt_tokens": prompt,
            "completion_tokens": generated,
        }
    )
    return StageData(fields=fields, arrays=arrays), final


class AnswerChunks:
    """The thinker's answer handed to the talker in chunks as it is made: the talker's spec has
    ``stream_input`` (``talker_text``), the pipeline runs ``async_chunk``.

    Every chunk holds the positions the thinker ran since the one before: ``sequences`` up to
    one token past them, ``thinker_embed`` and ``thinker_hidden`` rows, ``tts_special`` (whole
    in the first chunk, no rows after it), and the first also ``audio_feature_lengths``,
    ``prompt_tokens`` and ``voice``; arrays joined along their first axis give
    :func:`thinker_answer`'s output, which the last chunk completes (with every field). The
    first chunk goes as soon as the talker can build its prompt (the first answer token was
    fed), the later ones every ``every`` positions."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.rows_sent = 0  # thinker_embed / thinker_hidden rows handed on
        self.opened = False

    def due(self, prompt: int, rows: int) -> bool:
        """Whether ``rows`` ran positions (of a ``prompt``-token prompt) make a chunk now."""
        if not self.opened:
            return rows >= prompt + 1
        return rows - self.rows_sent >= self.every

    def chunk(
        self,
        *,
        prompt_ids: np.ndarray,
        answer: Sequence[int],
        embeds: np.ndarray,
        hidden: np.ndarray,
        tts_special: np.ndarray,
        audio_lengths: np.ndarray | None,
        voice: str,
    ) -> StageData:
        """The next chunk: ``embeds`` and ``hidden`` are the rows from ``rows_sent`` on."""
        start = self.rows_sent
        end = start + int(embeds.shape[0])
        sequences = np.concatenate([prompt_ids, np.asarray(answer, dtype=np.int64)])
        arrays = {
            "sequences": sequences[start + 1 if self.opened else 0 : end + 1].astype(np.int64),
            "thinker_embed": embeds,
            "thinker_hidden": hidden,
            "tts_special": tts_special if not self.opened else tts_special[:0],
        }
        fields: dict[str, Scalar] = {}
        if not self.opened:
            fields = {"voice": voice, "prompt_tokens": int(prompt_ids.shape[0])}
            if audio_lengths is not None:
                arrays["audio_feature_lengths"] = audio_lengths.astype(np.int64)
        self.opened = True
        self.rows_sent = end
        return StageData(fields=fields, arrays=arrays)

    def last(self, whole: StageData) -> StageData:
        """The last chunk, from the whole answer's output (itself when no chunk went)."""
        if not self.opened:
            return whole
        start = self.rows_sent
        a = whole.arrays
        arrays = {
            "sequences": a["sequences"][start + 1 :],
            "thinker_embed": a["thinker_embed"][start:],
            "thinker_hidden": a["thinker_hidden"][start:],
            "tts_special": a["tts_special"][:0],
        }
        return StageData(fields=dict(whole.fields), arrays=arrays)


def talker_chunk_tokens(ctx: EngineContext) -> int:
    """Every how many positions the thinker hands its answer on (:class:`AnswerChunks`):
    ``engine_extras.talker_chunk_tokens`` (default 2; 0: the whole answer at its end), where the
    pipeline runs ``async_chunk`` and a next stage takes a streamed input; else 0."""
    every = extra_int(ctx, "talker_chunk_tokens", 2, 0, 4096)
    pipeline, stage = ctx.pipeline, ctx.stage.stage_id
    streamed = any(pipeline.stage(j).stream_input for j in pipeline.downstream(stage))
    return every if ctx.async_chunk and streamed else 0
