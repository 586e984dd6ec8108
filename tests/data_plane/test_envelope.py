from __future__ import annotations

import base64
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane.codec import encode
from omni_mesh.data_plane.envelope import (
    ENVELOPE_VERSION,
    MAGIC,
    EnvelopeError,
    open_envelope,
    seal,
    seal_b64,
)
from omni_mesh.data_plane.messages import Payload, ShmRef, StageInput, Tensor
from omni_mesh.data_plane.signing import TAG_BYTES, sign
from omni_mesh.data_plane.tensors import array_from_tensor

from .samples import sample_stage_input

pytestmark = pytest.mark.unit

LIMIT = 1 << 20


def _open(blob: bytes | str, secret: bytes, pipeline: PipelineSpec, **kw: object) -> StageInput:
    options: dict[str, object] = {"expected_stage": 1, "max_bytes": LIMIT} | kw
    return open_envelope(blob, secret, pipeline=pipeline, **options)  # type: ignore[arg-type]


def _forge(body: bytes, secret: bytes, header: bytes = MAGIC + bytes([ENVELOPE_VERSION])) -> bytes:
    """An envelope around an arbitrary body, correctly tagged with ``secret``."""
    return header + body + sign(secret, header, body)


@pytest.mark.parametrize("form", ["bytes", "b64"])
def test_round_trip(form: str, secret: bytes, pipeline: PipelineSpec) -> None:
    si = sample_stage_input(stage_id=1)
    blob: bytes | str = seal(si, secret) if form == "bytes" else seal_b64(si, secret)
    if form == "b64":
        assert isinstance(blob, str) and "=" not in blob and "+" not in blob and "/" not in blob
    out = _open(blob, secret, pipeline)
    assert out == si
    assert out.request_id == "req-42"  # identity survives every hop (invariant 2)
    np.testing.assert_array_equal(
        array_from_tensor(out.payload.tensors["hidden"]),
        array_from_tensor(si.payload.tensors["hidden"]),
    )


def test_raw_layout(secret: bytes) -> None:
    si = sample_stage_input()
    blob = seal(si, secret)
    assert blob[:4] == b"OMNI" and blob[4] == ENVELOPE_VERSION
    assert blob[5:-TAG_BYTES] == encode(si)
    assert blob[-TAG_BYTES:] == sign(secret, blob[:-TAG_BYTES])


def test_expected_stage_none_accepts_any_stage_of_the_pipeline(
    secret: bytes, pipeline: PipelineSpec
) -> None:
    blob = seal(sample_stage_input(stage_id=2), secret)
    assert _open(blob, secret, pipeline, expected_stage=None).stage_id == 2


def test_open_accepts_bytearray_and_memoryview(secret: bytes, pipeline: PipelineSpec) -> None:
    blob = seal(sample_stage_input(), secret)
    assert _open(bytearray(blob), secret, pipeline).request_id == "req-42"  # type: ignore[arg-type]
    assert _open(memoryview(blob), secret, pipeline).request_id == "req-42"  # type: ignore[arg-type]


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _raw_body(**changes: object) -> bytes:
    raw = msgspec.msgpack.decode(encode(sample_stage_input()))
    raw.update(changes)
    return msgspec.msgpack.encode(raw)


SHM_REF = ShmRef(segment="omni-1-a-0", offset=0, nbytes=1)
SHM_PAYLOAD = Payload(tensors={"x": Tensor(dtype="int8", shape=(1,), shm=SHM_REF)})

# (case id, blob builder(secret), reason, message fragment)
FAILURES: list[tuple[str, Callable[[bytes], bytes | str], str, str]] = [
    ("not-base64", lambda s: "not*base64!", "not_base64", "not valid base64"),
    ("not-ascii", lambda s: "é" * 40, "not_base64", "not valid base64"),
    ("b64-too-large", lambda s: "A" * (LIMIT * 2), "too_large", f"limit of {LIMIT} bytes"),
    ("too-large", lambda s: b"OMNI" + bytes(LIMIT), "too_large", f"limit of {LIMIT}"),
    ("empty", lambda s: b"", "too_short", "too short"),
    ("too-short", lambda s: b"OMNI\x01" + bytes(TAG_BYTES), "too_short", "too short"),
    ("bad-magic", lambda s: b"JUNK\x01" + bytes(64), "bad_magic", "not an omni-mesh envelope"),
    (
        "unknown-version",
        lambda s: _forge(encode(sample_stage_input()), s, b"OMNI\x07"),
        "unknown_version",
        "unknown envelope version 7 (this server reads version 1)",
    ),
    (
        "wrong-secret",
        lambda s: seal(sample_stage_input(), b"another-secret"),
        "bad_tag",
        "bad tag",
    ),
    (
        "tampered",
        lambda s: seal(sample_stage_input(), s).replace(b"req-42", b"req-43"),
        "bad_tag",
        "modified",
    ),
    (
        "tag-checked-before-decoding",
        lambda s: _forge(b"\xc1 garbage", b"wrong-secret"),
        "bad_tag",
        "bad tag",
    ),
    ("undecodable", lambda s: _forge(b"\xc1 garbage", s), "undecodable", "malformed StageInput"),
    (
        "undecodable-field",
        lambda s: _forge(_raw_body(stage_id="two"), s),
        "undecodable",
        "`$.stage_id`",
    ),
    (
        "receiver-out-of-range",
        lambda s: _forge(_raw_body(stage_id=999), s),
        "undecodable",
        "`$.stage_id`",
    ),
    (
        "missing-receiver",
        lambda s: _forge(msgspec.msgpack.encode({"pipeline": "tiny-omni"}), s),
        "undecodable",
        "missing required field",
    ),
    (
        "unknown-schema-version",
        lambda s: _forge(_raw_body(version=99), s),
        "unknown_version",
        "schema version 99",
    ),
    (
        "shm-refs-inside",
        lambda s: _forge(encode(sample_stage_input(payload=SHM_PAYLOAD)), s),
        "bad_tensor",
        "shared-memory",
    ),
    (
        "pipeline-mismatch",
        lambda s: seal(sample_stage_input(pipeline="tiny-tts"), s),
        "pipeline_mismatch",
        "for pipeline 'tiny-tts', this server runs 'tiny-omni'",
    ),
    (
        "receiver-not-in-pipeline",
        lambda s: seal(sample_stage_input(stage_id=9), s),
        "unknown_stage",
        "receiver stage 9, which pipeline 'tiny-omni' does not have (stages: [0, 1, 2])",
    ),
    (
        "receiver-is-another-stage",
        lambda s: seal(sample_stage_input(stage_id=2), s),
        "wrong_stage",
        "stage_input is for stage 2, this call is for stage 1",
    ),
]


@pytest.mark.parametrize(
    ("build", "reason", "fragment"), [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES]
)
def test_each_failure_is_a_clear_envelope_error(
    build: Callable[[bytes], bytes | str],
    reason: str,
    fragment: str,
    secret: bytes,
    pipeline: PipelineSpec,
) -> None:
    blob = build(secret)
    for form in (blob, _b64(blob) if isinstance(blob, bytes) else None):
        if form is None or (isinstance(form, str) and len(form) > LIMIT * 4 // 3 + 4):
            continue
        with pytest.raises(EnvelopeError) as info:
            _open(form, secret, pipeline)
        assert info.value.reason == reason
        assert fragment in str(info.value)
        assert isinstance(info.value, ValueError)  # → HTTP 400, never a 500


def test_a_bit_flip_anywhere_is_caught(secret: bytes, pipeline: PipelineSpec) -> None:
    blob = seal(sample_stage_input(), secret)
    expected = {0: "bad_magic", 1: "bad_magic", 2: "bad_magic", 3: "bad_magic"}
    expected[4] = "unknown_version"
    for pos in range(len(blob)):
        for bit in (0, 7):
            flipped = bytearray(blob)
            flipped[pos] ^= 1 << bit
            with pytest.raises(EnvelopeError) as info:
                _open(bytes(flipped), secret, pipeline)
            assert info.value.reason == expected.get(pos, "bad_tag"), (pos, bit)


def test_seal_refuses_shared_memory_tensors(secret: bytes) -> None:
    si = sample_stage_input()
    si.payload.tensors["ref"] = Tensor(dtype="int8", shape=(1,), shm=SHM_REF)
    with pytest.raises(EnvelopeError, match=r"tensor\(s\) \['ref'\] are in shared memory"):
        seal(si, secret)


def test_empty_secret_is_a_configuration_error(pipeline: PipelineSpec) -> None:
    with pytest.raises(ValueError, match="secret"):
        seal(sample_stage_input(), b"")
    with pytest.raises(ValueError, match="secret"):
        _open(b"OMNI", b"", pipeline)
