"""Processors of the reference pipelines: stage k's output → stage j's input.

Each picks what the next stage reads and nothing else (hop payloads stay small), and carries the
prompt fields later stages need: the host copies the client's prompt fields into the entry stage
only. A missing output is an :class:`EngineInputError` naming the processor and the field.
"""

from __future__ import annotations

import numpy as np

from omni_mesh.engines.base import EngineInputError, StageData
from omni_mesh.engines.fields import passthrough


def _require(data: StageData, processor: str, name: str) -> np.ndarray:
    arr = data.arrays.get(name)
    if arr is None:
        raise EngineInputError(f"processor {processor}: upstream output lacks array {name!r}")
    return arr


def thinker_to_talker(data: StageData) -> StageData:
    """Thinker → talker: ``hidden_states`` [T, 1024], ``text_tokens`` (the generated count, which
    sets the number of audio frames) and ``voice``."""
    hidden = _require(data, "thinker_to_talker", "hidden_states")
    tokens = data.fields.get("generated_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        raise EngineInputError(
            "processor thinker_to_talker: upstream output lacks integer field 'generated_tokens'"
        )
    fields = {"text_tokens": tokens, **passthrough(data, ("voice",))}
    return StageData(fields=fields, arrays={"hidden_states": hidden})


def talker_to_code2wav(data: StageData) -> StageData:
    """Talker → code2wav: ``codes`` int64 [F, 4], and ``context_codes`` [M, 4] when the talker
    streams (the frames before a chunk, which code2wav decodes first and drops)."""
    arrays = {"codes": _require(data, "talker_to_code2wav", "codes")}
    context = data.arrays.get("context_codes")
    if context is not None:
        arrays["context_codes"] = context
    return StageData(arrays=arrays)


def ar_to_dit(data: StageData) -> StageData:
    """AR → DiT: ``image_tokens`` int64 [8, 8] plus the ``size`` and ``steps`` prompt fields."""
    tokens = _require(data, "ar_to_dit", "image_tokens")
    return StageData(fields=passthrough(data, ("size", "steps")), arrays={"image_tokens": tokens})
