"""numpy arrays ⇄ wire :class:`Tensor` values, zero-copy both ways, with validation.

A :class:`Tensor` on the wire is untrusted: its dtype, shape and byte count are checked against
an allow-list and against each other before any array is built over its bytes, and every
failure is a :class:`TensorError` naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from omni_mesh.data_plane.messages import Payload, Scalar, Tensor

if TYPE_CHECKING:
    from omni_mesh.data_plane.shm import ShmReader

#: dtypes that may cross a process boundary (numpy names). bfloat16 has no numpy dtype.
ALLOWED_DTYPES: frozenset[str] = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    }
)
MAX_RANK = 8
#: The allowed dtypes by name and back (``dtype.name`` costs a microsecond or more per call).
_DTYPES: dict[str, np.dtype[np.generic]] = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_NAMES: dict[np.dtype[np.generic], str] = {dtype: name for name, dtype in _DTYPES.items()}


class TensorError(ValueError):
    """A tensor is malformed (dtype, shape, byte count, storage) or cannot be encoded."""


# ---- arrays → tensors ------------------------------------------------------------------------


def tensor_from_array(a: np.ndarray) -> Tensor:
    """A tensor whose ``data`` is a zero-copy byte view of ``a`` (copied first only when ``a``
    is not C-contiguous or not little-endian). The array must outlive the tensor's use."""
    name = _NAMES.get(a.dtype)
    if name is not None and a.ndim <= MAX_RANK and a.flags.c_contiguous:  # the common case
        data = a.reshape(-1).view(np.uint8).data
        return Tensor(dtype=name, shape=tuple(int(d) for d in a.shape), data=data)
    dtype = np.dtype(a.dtype)
    if dtype.name not in ALLOWED_DTYPES:
        raise TensorError(
            f"cannot send an array of dtype {dtype.name!r} "
            f"(allowed: {', '.join(sorted(ALLOWED_DTYPES))})"
        )
    if a.ndim > MAX_RANK:
        raise TensorError(f"cannot send an array of rank {a.ndim} (max {MAX_RANK})")
    if dtype.byteorder == ">":
        a = a.astype(dtype.newbyteorder("<"))
    if not a.flags.c_contiguous:
        a = a.copy(order="C")
    data = a.reshape(-1).view(np.uint8).data
    return Tensor(dtype=dtype.name, shape=tuple(int(d) for d in a.shape), data=data)


def payload_from_arrays(
    fields: Mapping[str, Scalar] | None = None, arrays: Mapping[str, np.ndarray] | None = None
) -> Payload:
    """A payload holding ``fields`` and every array of ``arrays`` as an inline tensor."""
    tensors = {name: _tensor_named(name, a) for name, a in (arrays or {}).items()}
    return Payload(fields=dict(fields or {}), tensors=tensors)


# ---- tensors → arrays ------------------------------------------------------------------------


def check_tensor(t: Tensor, name: str = "tensor") -> np.dtype[np.generic]:
    """Validate ``t``'s header and storage; return its numpy dtype."""
    if t.dtype not in ALLOWED_DTYPES:
        hint = " (bfloat16 has no numpy dtype: send float32)" if t.dtype == "bfloat16" else ""
        raise TensorError(
            f"tensor {name!r}: dtype {t.dtype!r} is not allowed{hint} "
            f"(allowed: {', '.join(sorted(ALLOWED_DTYPES))})"
        )
    if len(t.shape) > MAX_RANK:
        raise TensorError(f"tensor {name!r}: rank {len(t.shape)} exceeds the maximum {MAX_RANK}")
    if any(d < 0 for d in t.shape):
        raise TensorError(f"tensor {name!r}: negative dimension in shape {list(t.shape)}")
    if (t.data is None) == (t.shm is None):
        raise TensorError(f"tensor {name!r}: exactly one of 'data' and 'shm' must be set")
    dtype = _DTYPES[t.dtype]
    expected = math.prod(t.shape) * dtype.itemsize
    actual = tensor_nbytes(t)
    if expected != actual:
        raise TensorError(
            f"tensor {name!r}: shape {list(t.shape)} of {t.dtype} needs {expected} bytes, "
            f"got {actual}"
        )
    return dtype


def array_from_tensor(
    t: Tensor, reader: ShmReader | None = None, *, name: str = "tensor"
) -> np.ndarray:
    """A zero-copy array over ``t``'s bytes (inline, or a mapped shared-memory slot through
    ``reader``); read-only when those bytes are. ``name`` is used in error messages."""
    dtype = check_tensor(t, name)
    if t.shm is not None:
        if reader is None:
            raise TensorError(f"tensor {name!r} is in shared memory but no reader was given")
        buf = reader.view(t.shm)
    else:
        assert t.data is not None  # check_tensor guarantees one of the two
        buf = t.data
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    return np.frombuffer(buf, dtype=dtype).reshape(t.shape)


def arrays_from_payload(payload: Payload, reader: ShmReader | None = None) -> dict[str, np.ndarray]:
    """Every tensor of ``payload`` as a zero-copy array, keyed by name."""
    return {name: array_from_tensor(t, reader, name=name) for name, t in payload.tensors.items()}


# ---- sizes -----------------------------------------------------------------------------------


def tensor_nbytes(t: Tensor) -> int:
    """Bytes of storage the tensor references (inline or in shared memory)."""
    if t.data is not None:
        return t.data.nbytes
    if t.shm is not None:
        return t.shm.nbytes
    return 0


def payload_nbytes(payload: Payload) -> int:
    """Total tensor bytes of a payload (inline and shared memory)."""
    return sum(tensor_nbytes(t) for t in payload.tensors.values())


def _tensor_named(name: str, a: np.ndarray) -> Tensor:
    try:
        return tensor_from_array(a)
    except TensorError as exc:
        raise TensorError(f"tensor {name!r}: {exc}") from None
