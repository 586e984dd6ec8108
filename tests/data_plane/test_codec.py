from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from omni_mesh.data_plane import messages as m
from omni_mesh.data_plane.codec import (
    CodecError,
    decode,
    decode_json,
    encode,
    encode_into,
    encode_json,
)
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array

from .samples import ENGINE_MESSAGES, OTHER_MESSAGES, sample_stage_input

pytestmark = pytest.mark.unit

ALL = ENGINE_MESSAGES + OTHER_MESSAGES


def _id(msg: object) -> str:
    return type(msg).__name__


@pytest.mark.parametrize("msg", ALL, ids=_id)
def test_round_trip_every_message(msg: Any) -> None:
    assert decode(encode(msg), type(msg)) == msg


@pytest.mark.parametrize("msg", ENGINE_MESSAGES, ids=_id)
def test_engine_messages_decode_through_the_tagged_union(msg: m.EngineMessage) -> None:
    out = decode(encode(msg), m.EngineMessage)
    assert type(out) is type(msg)
    assert out == msg


@pytest.mark.parametrize(
    "msg", [x for x in OTHER_MESSAGES if type(x).__name__.startswith("Run")], ids=_id
)
def test_client_messages_round_trip_as_json(msg: Any) -> None:
    assert decode_json(encode_json(msg), type(msg)) == msg


def test_decode_is_zero_copy_for_tensor_bytes() -> None:
    si = sample_stage_input()
    for buf in (encode(si), bytearray(encode(si))):
        out = decode(buf, m.StageInput)
        data = out.payload.tensors["hidden"].data
        assert data is not None
        assert data.obj is buf
        expected = array_from_tensor(si.payload.tensors["hidden"])
        np.testing.assert_array_equal(array_from_tensor(out.payload.tensors["hidden"]), expected)


def test_decode_from_a_memoryview_views_the_underlying_buffer() -> None:
    buf = bytearray(encode(sample_stage_input()))
    out = decode(memoryview(buf), m.StageInput)
    data = out.payload.tensors["codes"].data
    assert data is not None and data.obj is buf


def test_tensor_bytes_are_raw_not_lists() -> None:
    a = np.arange(100_000, dtype=np.float32)
    encoded = encode(tensor_from_array(a))
    assert len(encoded) < a.nbytes + 64
    assert a.tobytes() in encoded


def test_encode_into_reuses_the_buffer_and_honours_the_offset() -> None:
    buf = bytearray(b"HEAD")
    n = encode_into(m.Abort(key="r1"), buf, 4)
    assert n == len(buf) and buf[:4] == b"HEAD"
    assert decode(memoryview(buf)[4:], m.Abort) == m.Abort(key="r1")
    first = id(buf)
    encode_into(m.Abort(key="r2"), buf)
    assert id(buf) == first
    assert decode(buf, m.Abort).key == "r2"


def test_validation_error_names_the_path() -> None:
    bad = msgspec.msgpack.encode(
        {"fields": {}, "tensors": {"x": {"dtype": 5, "shape": [1], "data": b"abcd"}}}
    )
    with pytest.raises(CodecError) as info:
        decode(bad, m.Payload)
    assert info.value.path == "$.tensors[...].dtype"
    assert "`$.tensors[...].dtype`" in str(info.value)
    assert "Payload" in str(info.value)


def test_validation_error_deep_path() -> None:
    raw = msgspec.msgpack.decode(encode(sample_stage_input()))
    raw["payload"]["tensors"]["hidden"]["dtype"] = ["float32"]
    with pytest.raises(CodecError) as info:
        decode(msgspec.msgpack.encode(raw), m.StageInput)
    assert info.value.path == "$.payload.tensors[...].dtype"


def test_constraints_are_checked() -> None:
    raw = msgspec.msgpack.decode(encode(sample_stage_input()))
    raw["request_id"] = "bad id/with slash"
    with pytest.raises(CodecError, match=r"\$\.request_id"):
        decode(msgspec.msgpack.encode(raw), m.StageInput)


@pytest.mark.parametrize("data", [b"", b"\xc1", encode(m.Abort(key="r")) + b"\x00"])
def test_malformed_input_is_a_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError, match="malformed Abort") as info:
        decode(data, m.Abort)
    assert info.value.path is None


def test_malformed_json_is_a_codec_error() -> None:
    with pytest.raises(CodecError, match=r"\$\.stage_id"):
        decode_json(b'{"stage_id": "one", "stage_input": "x"}', m.RunRequest)
    with pytest.raises(CodecError, match="malformed"):
        decode_json(b"{", m.RunRequest)


def test_unsupported_objects_are_refused_not_pickled() -> None:
    class Opaque:
        pass

    with pytest.raises(CodecError, match="cannot encode"):
        encode(m.Payload(fields={"x": Opaque()}))  # type: ignore[dict-item]
    with pytest.raises(CodecError, match="cannot encode"):
        encode_into({"x": Opaque()}, bytearray())
