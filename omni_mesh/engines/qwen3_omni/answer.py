"""The thinker's answer in the shape the talker and the client read, whichever engine made it
(``thinker.py`` on transformers, ``vllm_thinker.py`` on vLLM): one definition, so the two hand
on the same arrays and fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import StageData


def stable_text(tokenizer: Any, tokens: Sequence[int]) -> str:
    """The text of ``tokens`` that later tokens cannot change (no trailing partial UTF-8
    character), special tokens dropped."""
    if not tokens:
        return ""
    return str(tokenizer.decode(list(tokens), skip_special_tokens=True)).rstrip("\ufffd")


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
