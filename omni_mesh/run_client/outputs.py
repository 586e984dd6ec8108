"""A run's outputs: the client-side join of a chunking stage's ``/v1/run`` outputs (``omni-run``
follows every chunk and joins them into the bytes the orchestrated path answers with), and where
``omni-run`` writes each media output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import RunOutputBin, Scalar


def join_run_outputs(parts: Sequence[RunOutputBin]) -> RunOutputBin:
    """One stage's output chunks, in chunk order, as one output: WAV audio → one WAV of the
    concatenated PCM (the bytes of the orchestrated path's joined audio), text and raw data
    concatenated; an image's chunks are its previews (partial images) then itself: the last.
    One part is returned as it is."""
    if not parts:
        raise ValueError("no output chunks to join")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    fields: dict[str, Scalar] = {}
    for part in parts:
        fields.update(part.fields)
    if first.kind == "image":
        return parts[-1]
    if first.text is not None and first.data is None:
        text = "".join(p.text or "" for p in parts)
        return RunOutputBin(first.kind, text=text, mime_type=first.mime_type, fields=fields)
    blobs = [p.data or b"" for p in parts]
    data = media.join_wavs(blobs) if first.mime_type == "audio/wav" else b"".join(blobs)
    return RunOutputBin(first.kind, first.text, data, first.mime_type, fields)


# ---- writing outputs ---------------------------------------------------------------------------

_SUFFIX = {"audio": ".wav", "image": ".png", "data": ".bin"}
_MIME_SUFFIX = {"audio/wav": ".wav", "image/png": ".png", "application/octet-stream": ".bin"}


def output_paths(outputs: Mapping[int, RunOutputBin], output: Path | None) -> dict[int, Path]:
    """Where each media output goes: ``output`` (or ``output.wav``/``.png``/``.bin``) when
    there is one; with several, ``<stem>-<stage id><suffix>``."""
    media = {k: v for k, v in sorted(outputs.items()) if v.data is not None}
    paths: dict[int, Path] = {}
    for stage_id, out in media.items():
        suffix = _MIME_SUFFIX.get(out.mime_type or "", _SUFFIX.get(out.kind, ".bin"))
        path = output if output is not None else Path(f"output{suffix}")
        if len(media) > 1:
            path = path.with_name(f"{path.stem}-{stage_id}{path.suffix or suffix}")
        paths[stage_id] = path
    return paths


def write_outputs(outputs: Mapping[int, RunOutputBin], output: Path | None) -> dict[int, Path]:
    """Write every media output to its :func:`output_paths` path; return the paths."""
    paths = output_paths(outputs, output)
    for stage_id, path in paths.items():
        path.write_bytes(outputs[stage_id].data or b"")
    return paths
