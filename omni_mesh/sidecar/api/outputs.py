"""Final outputs as a client sees them: text, WAV audio, PNG images, raw data.

With ``async_chunk`` a request's answer arrives as :class:`HopResult` frames, each carrying
some chunks of some stages' final outputs; :class:`ChunkAssembler` collects them by
(stage, chunk), hands each stage's chunks on in order as soon as they are contiguous (for
streaming routes) and joins them into one :class:`FinalOutput` per stage at the end (so the
unary routes answer the same with ``async_chunk`` on or off).
The client-side join of ``/v1/run`` chunk outputs (``omni-run``) is
:func:`omni_mesh.run_client.outputs.join_run_outputs`, giving the same bytes.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec
from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import (
    HopResult,
    Payload,
    RunOutput,
    RunOutputBin,
    Scalar,
    StageError,
    StageTiming,
)
from omni_mesh.data_plane.tensors import array_from_tensor
from omni_mesh.sidecar.api.text_logprobs import LOGPROB_FIELDS, TokenLogprobs


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
    logprobs: TokenLogprobs | None = None  # text: the tokens' logprobs, when asked (vLLM)
    prompt_logprobs: TokenLogprobs | None = None  # text, echo: the prompt's (first chunk)

    def encoded(self) -> FinalOutput:
        """This output with its client bytes (WAV, PNG) encoded from its array if they were
        left out (:func:`final_output` with ``encode=False``); milliseconds of CPU for a whole
        output: call it off the event loop."""
        if self.data is None and self.array is not None:
            if self.kind is OutputKind.AUDIO:
                rate = int((self.fields or {}).get("sample_rate") or 24000)
                self.data, self.mime_type = media.wav_bytes(self.array, rate), "audio/wav"
            elif self.kind is OutputKind.IMAGE:
                self.data, self.mime_type = media.png_bytes(self.array), "image/png"
        return self

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


#: Output kinds whose client bytes are encoded (WAV, PNG): CPU work of milliseconds.
ENCODED_KINDS = frozenset({OutputKind.AUDIO, OutputKind.IMAGE})


def final_output(
    pipeline: PipelineSpec, stage_id: int, payload: Payload, *, encode: bool = True
) -> FinalOutput:
    """Decode a final payload (tensors inline) into its client form; with ``encode=False``
    audio and images keep only their array (see :meth:`FinalOutput.encoded`)."""
    kind = pipeline.stage(stage_id).final_output or OutputKind.DATA
    arrays = {k: array_from_tensor(t) for k, t in payload.tensors.items()}
    fields = dict(payload.fields)
    if kind is OutputKind.TEXT:  # with the tokens' logprobs, when asked (vLLM)
        text = str(fields.pop("text", ""))
        logprobs = TokenLogprobs.read(fields, arrays)
        prompt_logprobs = TokenLogprobs.read(fields, arrays, prefix="prompt_")
        for name in LOGPROB_FIELDS:
            fields.pop(name, None)
        return FinalOutput(
            stage_id,
            kind,
            text=text,
            fields=fields,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    if kind is OutputKind.AUDIO:
        wave = arrays["waveform"]
        out = FinalOutput(stage_id, kind, fields=fields, array=wave)
        return out.encoded() if encode else out
    if kind is OutputKind.IMAGE:
        out = FinalOutput(stage_id, kind, fields=fields, array=arrays["image"])
        return out.encoded() if encode else out
    raw = arrays.get("data")
    blob = bytes(raw.reshape(-1).view(np.uint8)) if raw is not None else b""
    return FinalOutput(
        stage_id, kind, data=blob, mime_type="application/octet-stream", fields=fields
    )


# ---- chunked outputs -------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputChunk:
    """Chunk ``chunk`` of stage ``stage_id``'s final output, decoded (a whole output: chunk 0)."""

    stage_id: int
    chunk: int
    output: FinalOutput

    @property
    def kind(self) -> OutputKind:
        return self.output.kind

    @property
    def sample_rate(self) -> int:
        fields = self.output.fields or {}
        return int(fields.get("sample_rate") or 24000)


def join_outputs(parts: Sequence[FinalOutput]) -> FinalOutput:
    """One stage's output chunks, in chunk order, as one output: audio → one WAV of the
    concatenated waveforms, text → the concatenated text, data → the concatenated bytes; an
    image's chunks are pictures of it, its previews then itself: the last. A single part is
    returned as it is (the bytes of a whole output).
    Audio is joined from the parts' arrays and encoded here: call it off the event loop."""
    if not parts:
        raise ValueError("no output chunks to join")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    fields: dict[str, Scalar] = {}
    for part in parts:
        fields.update(part.fields or {})
    kind = first.kind
    if kind is OutputKind.TEXT:
        return FinalOutput(
            first.stage_id,
            kind,
            text="".join(p.text or "" for p in parts),
            fields=fields,
            logprobs=TokenLogprobs.join([p.logprobs for p in parts]),
            prompt_logprobs=next((p.prompt_logprobs for p in parts if p.prompt_logprobs), None),
        )
    if kind is OutputKind.AUDIO:
        rates = {int((p.fields or {}).get("sample_rate") or 24000) for p in parts}
        if len(rates) != 1:
            raise ValueError(f"stage {first.stage_id}: audio chunks at several rates {rates}")
        wave = np.concatenate([np.asarray(p.array).reshape(-1) for p in parts])
        return FinalOutput(first.stage_id, kind, fields=fields, array=wave).encoded()
    if kind is OutputKind.IMAGE:  # previews of the image (partial images), then the image
        return parts[-1]
    return FinalOutput(
        first.stage_id,
        kind,
        data=b"".join(p.data or b"" for p in parts),
        mime_type=first.mime_type,
        fields=fields,
    )


@dataclass
class ChunkAssembler:
    """Collects a request's final outputs from its answer frames (see module docstring).

    :meth:`add` returns the chunks that became contiguous, stage by stage in chunk order;
    duplicates (a replayed hop answering a chunk twice) are dropped. The first error frame
    ends the stream; :meth:`end` checks that it ended properly; :meth:`joined` joins."""

    pipeline: PipelineSpec
    error: StageError | None = None
    done: bool = False
    streamed: bool = False  # a frame with more=True arrived: the answer is a stream
    timings: list[StageTiming] = field(default_factory=list)
    duplicates: int = 0
    _chunks: dict[int, dict[int, FinalOutput]] = field(default_factory=dict)
    _next: dict[int, int] = field(default_factory=dict)

    def add(self, frame: HopResult) -> list[OutputChunk]:
        if self.done:
            return []
        self.timings.extend(frame.timings)
        if frame.error is not None:
            self.error, self.done = frame.error, True
            return []
        self.streamed = self.streamed or frame.more
        ready: list[OutputChunk] = []
        for stage_id in sorted(frame.outputs):
            chunk = frame.chunks.get(stage_id, 0)
            have = self._chunks.setdefault(stage_id, {})
            if chunk in have:
                self.duplicates += 1
                continue
            # Not encoded per chunk: streaming sinks send PCM from the array, and the joined
            # output is encoded once, off the loop (:func:`joined_off_loop`).
            output = final_output(self.pipeline, stage_id, frame.outputs[stage_id], encode=False)
            have[chunk] = output
            ready.extend(self._contiguous(stage_id))
        if not frame.more:
            self.done = True
            self.end()
        return ready

    def _contiguous(self, stage_id: int) -> list[OutputChunk]:
        have, out = self._chunks[stage_id], []
        n = self._next.get(stage_id, 0)
        while n in have:
            out.append(OutputChunk(stage_id, n, have[n]))
            n += 1
        self._next[stage_id] = n
        return out

    def end(self) -> StageError | None:
        """The stream's error, after checking that it ended with its last frame and that no
        stage's chunks have a gap."""
        if self.error is not None:
            return self.error
        if not self.done:
            self.error = StageError(
                code="engine_error", message="the answer stream ended before its last frame"
            )
        for stage_id, have in sorted(self._chunks.items()):
            n = self._next.get(stage_id, 0)
            if len(have) != n and self.error is None:
                self.error = StageError(
                    code="engine_error",
                    message=f"chunk {n} of the output never arrived (got chunks {sorted(have)})",
                    stage_id=stage_id,
                )
        self.done = True
        return self.error

    @property
    def encodes(self) -> bool:
        """Whether :meth:`joined` has WAV/PNG encoding to do."""
        return any(self.pipeline.stage(s).final_output in ENCODED_KINDS for s in self._chunks)

    def joined(self) -> list[FinalOutput]:
        """Every stage's final output, its chunks joined and encoded, in stage order."""
        return [
            join_outputs([have[c] for c in sorted(have)]).encoded()
            for _, have in sorted(self._chunks.items())
        ]


async def joined_off_loop(assembler: ChunkAssembler) -> list[FinalOutput]:
    """:meth:`ChunkAssembler.joined`, in a worker thread when it encodes WAV or PNG (CPU work
    of milliseconds that would stall every other request on the event loop)."""
    if assembler.encodes:
        return await asyncio.to_thread(assembler.joined)
    return assembler.joined()


def final_stage(pipeline: PipelineSpec, kind: OutputKind) -> int | None:
    """The first stage whose final output is of ``kind``."""
    return next((s.stage_id for s in pipeline.stages if s.final_output is kind), None)
