"""Processors of the vLLM pipelines (``tiny-omni-vllm``).

* thinker → talker: the thinker's new token ids mapped into the talker's vocabulary, which is
  the codec (:data:`~.tiny_models.CODEC_VOCAB` codes), as the talker's prompt; the talker's
  output budget is :data:`FRAMES_PER_TOKEN` frames of 4 codes per thinker token.
* talker → code2wav: the talker's tokens, 4 per frame, as ``codes`` [F, 4] (and its left
  context, ``context_token_ids``, as ``context_codes``) for the reference decoder.
"""

from __future__ import annotations

import numpy as np

from omni_mesh.engines.base import EngineInputError, StageData
from omni_mesh.engines.reference.codec import CODEBOOK_SIZE, NUM_CODEBOOKS
from omni_mesh.engines.vllm.tiny_models import CODEC_VOCAB

FRAMES_PER_TOKEN = 2
MAX_TALKER_TOKENS = 4096
_MULTIPLIER, _OFFSET = 37, 11  # a fixed permutation of the codec vocabulary


def _ids(data: StageData, processor: str, name: str) -> np.ndarray:
    arr = data.arrays.get(name)
    if arr is None:
        raise EngineInputError(f"processor {processor}: upstream output lacks array {name!r}")
    return np.asarray(arr, dtype=np.int64).reshape(-1)


def thinker_to_talker(data: StageData) -> StageData:
    """Thinker token ids → talker prompt ids (codec vocabulary) and ``max_tokens``."""
    ids = _ids(data, "thinker_to_talker", "token_ids")
    if ids.size == 0:  # a last chunk with no new token (a stop string): one silent frame's seed
        ids = np.zeros(1, dtype=np.int64)
    codes = (ids * _MULTIPLIER + _OFFSET) % CODEC_VOCAB
    budget = min(MAX_TALKER_TOKENS, int(ids.size) * FRAMES_PER_TOKEN * NUM_CODEBOOKS)
    fields = {k: v for k, v in data.fields.items() if k == "voice"}
    return StageData(fields={**fields, "max_tokens": budget}, arrays={"token_ids": codes})


def _frames(ids: np.ndarray, processor: str, name: str, keep_tail: bool) -> np.ndarray:
    usable = ids.size - ids.size % NUM_CODEBOOKS
    ids = ids[ids.size - usable :] if keep_tail else ids[:usable]
    if ids.size and (ids.min() < 0 or ids.max() >= CODEBOOK_SIZE):
        raise EngineInputError(f"processor {processor}: {name} outside the codec's range")
    return ids.reshape(-1, NUM_CODEBOOKS)


def talker_to_code2wav(data: StageData) -> StageData:
    """Talker tokens → ``codes`` [F, 4] (whole frames; at least one) and ``context_codes``."""
    ids = _ids(data, "talker_to_code2wav", "token_ids")
    codes = _frames(ids, "talker_to_code2wav", "token_ids", keep_tail=False)
    if codes.shape[0] == 0:
        raise EngineInputError(
            f"processor talker_to_code2wav: {ids.size} talker tokens make no whole frame "
            f"({NUM_CODEBOOKS} codes each): give the talker chunk_tokens in multiples of "
            f"{NUM_CODEBOOKS}"
        )
    arrays = {"codes": codes}
    context = data.arrays.get("context_token_ids")
    if context is not None:
        ctx_ids = np.asarray(context, dtype=np.int64).reshape(-1)
        ctx_codes = _frames(ctx_ids, "talker_to_code2wav", "context_token_ids", keep_tail=True)
        if ctx_codes.shape[0]:
            arrays["context_codes"] = ctx_codes
    return StageData(arrays=arrays)
