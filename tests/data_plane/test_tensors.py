from __future__ import annotations

import numpy as np
import pytest

from omni_mesh.data_plane.messages import Payload, ShmRef, Tensor
from omni_mesh.data_plane.shm import ShmArena, ShmReader
from omni_mesh.data_plane.tensors import (
    ALLOWED_DTYPES,
    TensorError,
    array_from_tensor,
    arrays_from_payload,
    payload_from_arrays,
    payload_nbytes,
    tensor_from_array,
    tensor_nbytes,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
def test_round_trip_every_allowed_dtype(dtype: str) -> None:
    a = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    t = tensor_from_array(a)
    assert (t.dtype, t.shape) == (dtype, (2, 3, 4))
    b = array_from_tensor(t)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_both_directions_are_zero_copy() -> None:
    a = np.arange(1000, dtype=np.float32)
    t = tensor_from_array(a)
    b = array_from_tensor(t)
    assert np.shares_memory(a, b)


@pytest.mark.parametrize(
    "a",
    [np.array(2.5), np.zeros((0, 4), np.float32), np.zeros((1,) * 8, np.int8)],
    ids=["scalar", "empty", "rank8"],
)
def test_edge_shapes(a: np.ndarray) -> None:
    b = array_from_tensor(tensor_from_array(a))
    assert b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_non_contiguous_and_big_endian_arrays_are_normalised() -> None:
    a = np.arange(12, dtype=">i4").reshape(3, 4).T
    t = tensor_from_array(a)
    assert t.dtype == "int32" and t.shape == (4, 3)
    np.testing.assert_array_equal(array_from_tensor(t), a)


@pytest.mark.parametrize(
    ("a", "match"),
    [
        (np.array([object()], dtype=object), "dtype 'object'"),
        (np.zeros(2, np.complex64), "dtype 'complex64'"),
        (np.array(["a"]), "dtype 'str"),
        (np.zeros((1,) * 9, np.int8), "rank 9"),
    ],
    ids=["object", "complex", "str", "rank9"],
)
def test_unsendable_arrays_are_refused(a: np.ndarray, match: str) -> None:
    with pytest.raises(TensorError, match=match):
        tensor_from_array(a)


def test_payload_from_arrays_names_the_bad_array() -> None:
    with pytest.raises(TensorError, match="tensor 'objs'"):
        payload_from_arrays(arrays={"objs": np.array([None], dtype=object)})


def _t(dtype: str = "float32", shape: tuple[int, ...] = (2,), nbytes: int = 8) -> Tensor:
    return Tensor(dtype=dtype, shape=shape, data=memoryview(bytes(nbytes)))


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (_t(dtype="bfloat16"), "dtype 'bfloat16' is not allowed .*bfloat16 has no numpy"),
        (_t(dtype="object"), "dtype 'object' is not allowed"),
        (_t(dtype="<f4"), "dtype '<f4' is not allowed"),
        (_t(shape=(1,) * 9, nbytes=4), "rank 9 exceeds the maximum 8"),
        (_t(shape=(2, -1)), r"negative dimension in shape \[2, -1\]"),
        (_t(nbytes=7), r"shape \[2\] of float32 needs 8 bytes, got 7"),
        (_t(shape=(2**62, 2**62)), r"shape \[\d+, \d+\] of float32 needs \d+ bytes, got 8"),
        (Tensor(dtype="int8", shape=(1,)), "exactly one of 'data' and 'shm'"),
        (
            Tensor(
                dtype="int8",
                shape=(1,),
                data=memoryview(b"x"),
                shm=ShmRef(segment="omni-1-a-0", offset=0, nbytes=1),
            ),
            "exactly one of 'data' and 'shm'",
        ),
    ],
    ids=[
        "bfloat16",
        "object",
        "non-canonical",
        "rank",
        "negative",
        "nbytes",
        "overflow",
        "no-storage",
        "two-storages",
    ],
)
def test_malformed_tensors_are_refused_with_their_name(tensor: Tensor, match: str) -> None:
    with pytest.raises(TensorError, match=f"tensor 'hidden': {match}"):
        array_from_tensor(tensor, name="hidden")


def test_tensor_error_is_a_value_error() -> None:
    assert issubclass(TensorError, ValueError)


def test_shm_tensor_needs_a_reader() -> None:
    t = Tensor(dtype="int8", shape=(4,), shm=ShmRef(segment="omni-1-a-0", offset=0, nbytes=4))
    with pytest.raises(TensorError, match="no reader"):
        array_from_tensor(t, name="x")


def test_shm_tensor_reads_through_the_reader() -> None:
    a = np.arange(256, dtype=np.uint16)
    with ShmArena() as arena, ShmReader() as reader:
        slot = arena.alloc(a.nbytes, "req-1")
        slot.view[:] = a.data.cast("B")
        t = Tensor(dtype="uint16", shape=(256,), shm=slot.ref)
        b = array_from_tensor(t, reader)
        np.testing.assert_array_equal(a, b)
        assert not b.flags.writeable
        del b


def test_sizes() -> None:
    p = payload_from_arrays(
        {"x": 1}, {"a": np.zeros(10, np.float64), "b": np.zeros((2, 3), np.int8)}
    )
    shm = Tensor(dtype="int8", shape=(5,), shm=ShmRef(segment="omni-1-a-0", offset=0, nbytes=5))
    p.tensors["c"] = shm
    assert tensor_nbytes(shm) == 5
    assert payload_nbytes(p) == 80 + 6 + 5
    assert payload_nbytes(Payload()) == 0


def test_arrays_from_payload() -> None:
    arrays: dict[str, np.ndarray] = {"a": np.arange(3), "b": np.ones((2, 2), np.float16)}
    out = arrays_from_payload(payload_from_arrays(arrays=arrays))
    assert out.keys() == arrays.keys()
    for name, a in arrays.items():
        np.testing.assert_array_equal(out[name], a)
