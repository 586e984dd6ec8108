"""Final outputs as a client sees them: text, WAV audio, PNG images, raw data."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from omni_mesh.configs.pipeline import OutputKind, PipelineSpec
from omni_mesh.data_plane.messages import Payload, RunOutput, RunOutputBin, Scalar
from omni_mesh.data_plane.tensors import array_from_tensor
from omni_mesh.sidecar import media


@dataclass
class FinalOutput:
    """One stage's contribution to the answer, decoded and encoded for clients."""

    stage_id: int
    kind: OutputKind
    text: str | None = None
    data: bytes | None = None
    mime_type: str | None = None
    fields: dict[str, Scalar] | None = None
    array: np.ndarray | None = None  # waveform or image, for routes that re-encode

    def to_run_output(self) -> RunOutput:
        return RunOutput(
            kind=self.kind.value,
            text=self.text,
            data=base64.b64encode(self.data).decode() if self.data is not None else None,
            mime_type=self.mime_type,
            fields=self.fields or {},
        )

    def to_run_output_bin(self) -> RunOutputBin:
        return RunOutputBin(
            kind=self.kind.value,
            text=self.text,
            data=self.data,
            mime_type=self.mime_type,
            fields=self.fields or {},
        )


def final_output(pipeline: PipelineSpec, stage_id: int, payload: Payload) -> FinalOutput:
    """Decode a final payload (tensors inline) into its client form."""
    kind = pipeline.stage(stage_id).final_output or OutputKind.DATA
    arrays = {k: array_from_tensor(t) for k, t in payload.tensors.items()}
    fields = dict(payload.fields)
    if kind is OutputKind.TEXT:
        return FinalOutput(stage_id, kind, text=str(fields.pop("text", "")), fields=fields)
    if kind is OutputKind.AUDIO:
        wave = arrays["waveform"]
        rate = int(fields.get("sample_rate") or 24000)
        return FinalOutput(
            stage_id,
            kind,
            data=media.wav_bytes(wave, rate),
            mime_type="audio/wav",
            fields=fields,
            array=wave,
        )
    if kind is OutputKind.IMAGE:
        image = arrays["image"]
        return FinalOutput(
            stage_id,
            kind,
            data=media.png_bytes(image),
            mime_type="image/png",
            fields=fields,
            array=image,
        )
    raw = arrays.get("data")
    blob = bytes(raw.reshape(-1).view(np.uint8)) if raw is not None else b""
    return FinalOutput(
        stage_id, kind, data=blob, mime_type="application/octet-stream", fields=fields
    )


def final_outputs(pipeline: PipelineSpec, outputs: dict[int, Payload]) -> list[FinalOutput]:
    return [final_output(pipeline, sid, outputs[sid]) for sid in sorted(outputs)]
