"""``/v1/run`` bodies both ways, in JSON (opaque inputs as base64 strings) and msgpack (raw
bytes): a call's request body, an answer in one shape whatever its encoding, and the message of
an error answer."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import msgspec

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.messages import (
    Prompt,
    RunOutput,
    RunOutputBin,
    RunRequest,
    RunRequestBin,
    RunResponse,
    RunResponseBin,
    SamplingParams,
)

MAX_ERROR_CHARS = 2000

Opaque = str | bytes
StageInputValue = Opaque | Prompt | list[Opaque]  # a list: a join's inputs, one per source


@dataclass(frozen=True)
class Answer:
    """A ``/v1/run`` answer: the call's outputs by stage and its next inputs."""

    stage_id: int
    request_id: str
    chunk: int
    outputs: dict[int, RunOutputBin]
    next: list[tuple[int, str | bytes]]


def encode_call(
    stage_id: int, stage_input: StageInputValue, sampling: SamplingParams | None, *, msgpack: bool
) -> bytes:
    """The body of a call to ``stage_id``; a list of inputs is a join call (``stage_inputs``)."""
    if msgpack:
        if isinstance(stage_input, list):
            raws = _raw_join(stage_input)
            return codec.encode(
                RunRequestBin(stage_id, sampling_params=sampling, stage_inputs=raws)
            )
        return codec.encode(RunRequestBin(stage_id, _raw(stage_input), sampling))
    if isinstance(stage_input, list):
        texts = _text_join(stage_input)
        return codec.encode_json(RunRequest(stage_id, sampling_params=sampling, stage_inputs=texts))
    return codec.encode_json(RunRequest(stage_id, _text(stage_input), sampling))


def decode_answer(resp: RunResponse | RunResponseBin) -> Answer:
    """An answer in one shape whatever its encoding (media as raw bytes)."""
    outputs = {k: _output_bin(v) for k, v in (resp.outputs or {}).items()}
    if resp.output is not None:
        outputs[resp.stage_id] = _output_bin(resp.output)
    nexts: list[tuple[int, str | bytes]] = [(n.stage_id, n.stage_input) for n in resp.next or ()]
    if not nexts and resp.next_stage_id is not None:
        if resp.stage_input is None:
            raise ValueError("next_stage_id without stage_input")
        nexts.append((resp.next_stage_id, resp.stage_input))
    return Answer(resp.stage_id, resp.request_id, resp.chunk, outputs, nexts)


def _output_bin(out: RunOutput | RunOutputBin) -> RunOutputBin:
    """Outputs as raw bytes: JSON answers carry media as base64."""
    if isinstance(out, RunOutputBin):
        return out
    try:
        data = None if out.data is None else base64.b64decode(out.data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"output data of kind {out.kind!r} is not base64: {exc}") from None
    return RunOutputBin(out.kind, out.text, data, out.mime_type, dict(out.fields))


def error_message(body: bytes) -> str:
    """The message of an error answer: ``{"error": {"message", "field"?}}``, ``{"error": "…"}``
    (JSON or msgpack), or the body as text."""
    doc: object = None
    for decode in (msgspec.json.decode, msgspec.msgpack.decode):
        try:
            doc = decode(body)
            break
        except msgspec.DecodeError:
            continue
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, str):
            return err[:MAX_ERROR_CHARS]
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message: str = err["message"]
            fld = err.get("field")
            if isinstance(fld, str) and fld not in message:
                message = f"{fld}: {message}"
            return message[:MAX_ERROR_CHARS]
    text = body.decode("utf-8", errors="replace").strip()
    return text[:MAX_ERROR_CHARS] or "(empty body)"


def _raw(value: Opaque | Prompt) -> bytes | Prompt:
    if isinstance(value, str):
        raise TypeError("msgpack mode carries stage inputs as bytes")
    return value


def _text(value: Opaque | Prompt) -> str | Prompt:
    if isinstance(value, bytes):
        raise TypeError("JSON mode carries stage inputs as base64 strings")
    return value


def _raw_join(values: list[Opaque]) -> list[bytes]:
    if any(isinstance(v, str) for v in values):
        raise TypeError("msgpack mode carries stage inputs as bytes")
    return [v for v in values if isinstance(v, bytes)]


def _text_join(values: list[Opaque]) -> list[str]:
    if any(isinstance(v, bytes) for v in values):
        raise TypeError("JSON mode carries stage inputs as base64 strings")
    return [v for v in values if isinstance(v, str)]
