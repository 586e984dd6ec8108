"""Typed, validated access to a request's :class:`~omni_mesh.engines.base.StageData`: every
problem is an :class:`~omni_mesh.engines.base.EngineInputError` naming the stage and the field,
so a bad request fails alone, before any compute is spent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_mesh.engines.base import EngineInputError, StageData

#: Longest prompt (in UTF-8 bytes) an engine accepts unless its ``max_prompt_bytes`` says.
DEFAULT_MAX_PROMPT_BYTES = 4096


@dataclass(frozen=True)
class FieldReader:
    """Typed access to one request's :class:`StageData`; every problem is an
    :class:`EngineInputError` that names the stage (``where``) and the field or array."""

    where: str
    data: StageData

    def error(self, kind: str, name: str, problem: str) -> EngineInputError:
        return EngineInputError(f"{self.where}: {kind} {name!r} {problem}")

    def has(self, name: str) -> bool:
        return self.data.fields.get(name) is not None

    def prompt_bytes(self, name: str, max_bytes: int) -> bytes:
        value = self.data.fields.get(name)
        if value is None:
            raise self.error("field", name, "is required")
        if not isinstance(value, str):
            raise self.error("field", name, f"must be a string, got {type(value).__name__}")
        raw = value.encode("utf-8", errors="replace")
        if not raw:
            raise self.error("field", name, "must not be empty")
        if len(raw) > max_bytes:
            raise self.error("field", name, f"is {len(raw)} bytes long; the limit is {max_bytes}")
        return raw

    def optional_str(self, name: str, default: str) -> str:
        value = self.data.fields.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error("field", name, f"must be a string, got {type(value).__name__}")
        return value

    def optional_int(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        value = self.data.fields.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error("field", name, f"must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise self.error("field", name, f"must be in [{lo}, {hi}], got {value}")
        return value

    def array(
        self, name: str, dtype: type[np.generic], shape: tuple[int | None, ...]
    ) -> np.ndarray:
        """The array ``name`` with exactly ``dtype`` and ``shape`` (``None``: any length >= 1)."""
        arr = self.data.arrays.get(name)
        if arr is None:
            raise self.error("array", name, "is required")
        if not isinstance(arr, np.ndarray):
            raise self.error("array", name, f"must be an array, got {type(arr).__name__}")
        if arr.dtype != np.dtype(dtype):
            raise self.error("array", name, f"must be {np.dtype(dtype)}, got {arr.dtype}")
        want = "(" + ", ".join("N" if d is None else str(d) for d in shape) + ")"
        if arr.ndim != len(shape) or any(
            (d is None and n < 1) or (d is not None and n != d)
            for n, d in zip(arr.shape, shape, strict=True)
        ):
            raise self.error("array", name, f"must have shape {want}, got {arr.shape}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise self.error("array", name, "holds NaN or infinite values")
        return arr

    def int_array(
        self, name: str, shape: tuple[int | None, ...], vocab: int, max_len: int
    ) -> np.ndarray:
        """An int64 array of token ids in ``[0, vocab)`` whose leading dim is at most max_len."""
        arr = self.array(name, np.int64, shape)
        if arr.shape[0] > max_len:
            raise self.error("array", name, f"has {arr.shape[0]} rows; the limit is {max_len}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab):
            raise self.error("array", name, f"must hold ids in [0, {vocab})")
        return arr


def passthrough(data: StageData, names: Sequence[str]) -> dict[str, Any]:
    """The fields of ``data`` among ``names`` that are set (to carry prompt fields downstream)."""
    return {n: data.fields[n] for n in names if data.fields.get(n) is not None}
