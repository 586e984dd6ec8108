"""The opaque ``stage_input`` of ``/v1/run`` (DESIGN §5, invariants 2 and 7).

Layout: ``b"OMNI"`` + one version byte + msgpack(:class:`StageInput`, every tensor inline) +
HMAC-SHA256 tag over everything before it. JSON clients see it as unpadded urlsafe base64;
msgpack clients as raw bytes. Clients never parse it; the tag stops them forging it.

:func:`open_envelope` checks, in order: size, framing, version, tag (*before* decoding
anything), body, pipeline, receiver stage — and each failure is an :class:`EnvelopeError`
(a ``ValueError`` → 400) whose message says what is wrong. The ``request_id`` inside is the
request's for its whole life (invariant 2): sealing and opening never change it.
"""

from __future__ import annotations

import base64
import binascii

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane.codec import CodecError, decode, encode_into
from omni_mesh.data_plane.messages import SCHEMA_VERSION, StageInput
from omni_mesh.data_plane.signing import TAG_BYTES, check_secret, sign, verify

MAGIC = b"OMNI"
ENVELOPE_VERSION = 1
_HEADER = MAGIC + bytes([ENVELOPE_VERSION])
_MIN_BYTES = len(_HEADER) + 1 + TAG_BYTES

Blob = bytes | bytearray | memoryview | str


class EnvelopeError(ValueError):
    """A ``stage_input`` is unusable. ``reason`` is a stable short code (for metrics and
    tests): not_base64, too_large, too_short, bad_magic, unknown_version, bad_tag,
    undecodable, bad_tensor, pipeline_mismatch, unknown_stage, wrong_stage."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---- sealing ---------------------------------------------------------------------------------


def seal(si: StageInput, secret: bytes) -> bytes:
    """The envelope bytes of ``si``. Every tensor must be inline (no shared-memory refs)."""
    return bytes(_seal(si, secret))


def seal_b64(si: StageInput, secret: bytes) -> str:
    """The envelope as unpadded urlsafe base64 (the JSON form of ``stage_input``)."""
    return base64.urlsafe_b64encode(_seal(si, secret)).rstrip(b"=").decode("ascii")


def _seal(si: StageInput, secret: bytes) -> bytearray:
    check_secret(secret)
    shm = sorted(name for name, t in si.payload.tensors.items() if t.shm is not None)
    if shm:
        raise EnvelopeError(
            "bad_tensor",
            f"cannot seal stage_input for stage {si.stage_id}: tensor(s) {shm} are in shared "
            "memory; inline them first",
        )
    buf = bytearray(_HEADER)
    encode_into(si, buf, len(_HEADER))
    buf += sign(secret, buf)
    return buf


# ---- opening ---------------------------------------------------------------------------------


def open_envelope(
    blob: Blob,
    secret: bytes,
    *,
    expected_stage: int | None,
    pipeline: PipelineSpec,
    max_bytes: int,
) -> StageInput:
    """The :class:`StageInput` sealed in ``blob`` (base64 ``str`` or raw bytes), checked to be
    untampered, for ``pipeline`` and — when ``expected_stage`` is given — for that stage.
    Tensor ``data`` are zero-copy views into the decoded bytes."""
    check_secret(secret)
    raw = _raw_bytes(blob, max_bytes)
    if len(raw) > max_bytes:
        raise EnvelopeError(
            "too_large", f"stage_input is {len(raw)} bytes, more than the limit of {max_bytes}"
        )
    view = memoryview(raw)
    if len(raw) < _MIN_BYTES:
        raise EnvelopeError(
            "too_short", f"stage_input is {len(raw)} bytes, too short to be an envelope"
        )
    if view[: len(MAGIC)] != MAGIC:
        raise EnvelopeError("bad_magic", "stage_input is not an omni-mesh envelope (bad magic)")
    if raw[len(MAGIC)] != ENVELOPE_VERSION:
        raise EnvelopeError(
            "unknown_version",
            f"stage_input has unknown envelope version {raw[len(MAGIC)]} "
            f"(this server reads version {ENVELOPE_VERSION})",
        )
    if not verify(secret, view[-TAG_BYTES:], view[:-TAG_BYTES]):
        raise EnvelopeError(
            "bad_tag",
            "stage_input failed its integrity check (bad tag): it was modified, or sealed "
            "by a deployment with another secret",
        )
    si = _decode_body(view[len(_HEADER) : -TAG_BYTES])
    _check_receiver(si, pipeline, expected_stage)
    return si


def _raw_bytes(blob: Blob, max_bytes: int) -> bytes | bytearray | memoryview:
    if not isinstance(blob, str):
        return blob
    max_chars = -(-max_bytes // 3) * 4
    if len(blob) > max_chars:
        raise EnvelopeError(
            "too_large",
            f"stage_input is {len(blob)} base64 characters, more than the limit of "
            f"{max_bytes} bytes",
        )
    try:
        return base64.b64decode(blob + "=" * (-len(blob) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise EnvelopeError(
            "not_base64", "stage_input is not valid base64 (urlsafe alphabet expected)"
        ) from None


def _decode_body(body: memoryview) -> StageInput:
    try:
        si = decode(body, StageInput)
    except CodecError as exc:
        raise EnvelopeError("undecodable", f"stage_input body is undecodable: {exc}") from None
    if si.version != SCHEMA_VERSION:
        raise EnvelopeError(
            "unknown_version",
            f"stage_input has unknown schema version {si.version} "
            f"(this server reads version {SCHEMA_VERSION})",
        )
    if any(t.shm is not None for t in si.payload.tensors.values()):
        raise EnvelopeError("bad_tensor", "stage_input carries shared-memory tensor refs")
    return si


def _check_receiver(si: StageInput, pipeline: PipelineSpec, expected_stage: int | None) -> None:
    if si.pipeline != pipeline.name:
        raise EnvelopeError(
            "pipeline_mismatch",
            f"stage_input is for pipeline {si.pipeline!r}, this server runs {pipeline.name!r}",
        )
    if si.stage_id not in pipeline.stage_ids:
        raise EnvelopeError(
            "unknown_stage",
            f"stage_input names receiver stage {si.stage_id}, which pipeline "
            f"{pipeline.name!r} does not have (stages: {sorted(pipeline.stage_ids)})",
        )
    if expected_stage is not None and si.stage_id != expected_stage:
        raise EnvelopeError(
            "wrong_stage",
            f"stage_input is for stage {si.stage_id}, this call is for stage {expected_stage}",
        )
