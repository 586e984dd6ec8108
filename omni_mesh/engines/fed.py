"""A streamed input's data as its chunks arrive (a stage whose spec has ``stream_input``).

The request is opened on the first chunk; each later chunk's arrays are appended to the arrays
of the same name along their first axis and its fields replace those of the same name, so the
input after the last chunk is the whole input the sender would have handed on in one piece.
Arrays grow in place with room to spare (amortised: a chunk costs its own rows, not the whole
array again), and the request's :class:`StageData` is updated in place: an engine that keeps
the request sees every chunk that has arrived at each step.
"""

from __future__ import annotations

import numpy as np

from omni_mesh.engines.base import EngineInputError, StageData


class FedInput:
    """The growing input of one streamed request (module docstring)."""

    def __init__(self, data: StageData) -> None:
        self.data = data
        self._buffers: dict[str, np.ndarray] = {}  # name -> array with room; data holds views
        self.chunks = 1

    def append(self, chunk: StageData) -> None:
        """Merge one later chunk; raises :class:`EngineInputError` (the request then fails)
        for an array whose dtype or trailing shape differs from what came before."""
        for name, arr in chunk.arrays.items():
            have = self.data.arrays.get(name)
            if have is None:
                self.data.arrays[name] = arr.copy()
                continue
            if (
                arr.dtype != have.dtype
                or arr.shape[1:] != have.shape[1:]
                or arr.ndim == 0
                or have.ndim == 0
            ):
                raise EngineInputError(
                    f"streamed input chunk {self.chunks}: array {name!r} is {arr.dtype}"
                    f"{list(arr.shape)}, earlier chunks gave {have.dtype}{list(have.shape)}"
                )
            if arr.shape[0]:
                self.data.arrays[name] = self._grown(name, have, arr)
        self.data.fields.update(chunk.fields)
        self.chunks += 1

    def _grown(self, name: str, have: np.ndarray, arr: np.ndarray) -> np.ndarray:
        n, m = have.shape[0], arr.shape[0]
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] < n + m:
            buffer = np.empty((max(2 * (n + m), 64), *have.shape[1:]), dtype=have.dtype)
            buffer[:n] = have
            self._buffers[name] = buffer
        buffer[n : n + m] = arr
        return buffer[: n + m]
