"""The client-side join of a chunking stage's ``/v1/run`` outputs: ``omni-run`` follows every
chunk and joins them into the bytes the orchestrated path answers with."""

from __future__ import annotations

from collections.abc import Sequence

from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import RunOutputBin, Scalar


def join_run_outputs(parts: Sequence[RunOutputBin]) -> RunOutputBin:
    """One stage's output chunks, in chunk order, as one output: WAV audio → one WAV of the
    concatenated PCM (the bytes of the orchestrated path's joined audio), text and raw data
    concatenated; an image cannot come in chunks. One part is returned as it is."""
    if not parts:
        raise ValueError("no output chunks to join")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    fields: dict[str, Scalar] = {}
    for part in parts:
        fields.update(part.fields)
    if first.kind == "image":
        raise ValueError("an image output cannot come in chunks")
    if first.text is not None and first.data is None:
        text = "".join(p.text or "" for p in parts)
        return RunOutputBin(first.kind, text=text, mime_type=first.mime_type, fields=fields)
    blobs = [p.data or b"" for p in parts]
    data = media.join_wavs(blobs) if first.mime_type == "audio/wav" else b"".join(blobs)
    return RunOutputBin(first.kind, first.text, data, first.mime_type, fields)
