"""Codec frames between a talker and its code2wav: the streamed chunk and its validation.

A talker streams its frames in chunks: array ``codes`` int64 [n, G] (the new frames, frame
major), fields ``num_frames`` (n) and ``frame_offset`` (frames before the chunk), and, except
on the first chunk, ``context_codes`` int64 [m, G]: the m = min(context, offset) frames just
before the chunk, which code2wav decodes first so the chunk's audio continues the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import EngineResult, StageData
from omni_mesh.engines.fields import FieldReader


def codes_chunk(
    request_id: str,
    frames: Sequence[np.ndarray],
    sent: int,
    groups: int,
    context_frames: int,
    *,
    last: bool,
) -> EngineResult:
    """The chunk of ``frames[sent:]`` (each frame int64 [G]) with its context (module doc)."""
    new = frames[sent:]
    codes = np.stack(new) if len(new) else np.zeros((0, groups), np.int64)
    arrays = {"codes": codes}
    context = min(context_frames, sent)
    if context:
        arrays["context_codes"] = np.stack(frames[sent - context : sent])
    fields: dict[str, Scalar] = {"num_frames": len(new), "frame_offset": sent}
    return EngineResult(request_id, output=StageData(fields=fields, arrays=arrays), last=last)


def codes_array(
    fields: FieldReader, name: str, groups: int, codebook: int, max_frames: int, *, required: bool
) -> np.ndarray | None:
    """Array ``name``: int64 [F, groups] of codes in [0, codebook), F <= max_frames (F may be
    0: a stream's empty last chunk); None when absent and not ``required``."""
    arr = fields.data.arrays.get(name)
    if arr is None:
        if required:
            raise fields.error("array", name, "is required")
        return None
    if not isinstance(arr, np.ndarray) or arr.dtype != np.int64 or arr.ndim != 2:
        raise fields.error("array", name, f"must be int64 [F, {groups}]")
    if arr.shape[1] != groups or arr.shape[0] > max_frames:
        raise fields.error("array", name, f"must have shape (F, {groups}), got {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= codebook):
        raise fields.error("array", name, f"must hold codes in [0, {codebook})")
    return arr
