"""A streamed input's data as its chunks arrive (a stage whose spec has ``stream_input``).

The request is opened on the first chunk; each later chunk's arrays are appended to the arrays
of the same name along their first axis and its fields replace those of the same name, so the
input after the last chunk is the whole input the sender would have handed on in one piece.
Arrays grow in place with room to spare (amortised: a chunk costs its own rows, not the whole
array again), and the request's :class:`StageData` is updated in place: an engine that keeps
the request sees every chunk that has arrived at each step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from omni_mesh.data_plane.messages import StageInput
from omni_mesh.engines.base import EngineInputError, EngineRequest, StageData


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


class FedRequest:
    """A running streamed request's input: its chunks merged in order (a chunk seen already is
    dropped, one out of order fails the request), ``last`` set on the request with the final
    one. A chunk that cannot be merged leaves :attr:`error` set: the request fails with it."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.input = FedInput(request.data)
        self.error = ""

    def take(self, chunk: int, last: bool, data: Callable[[], StageData]) -> None:
        """Merge chunk ``chunk`` (``data()`` builds it, and may raise for a bad one)."""
        if self.error or chunk < self.input.chunks:
            return  # failed already, or pulled again after a broken pull: seen already
        try:
            if chunk != self.input.chunks:
                raise EngineInputError(
                    f"streamed input: chunk {chunk} came where chunk {self.input.chunks} was due"
                )
            self.input.append(data())
        except (EngineInputError, ValueError) as exc:
            self.error = str(exc)
            return
        if last:
            self.request.last = True


class EarlyChunks:
    """Later chunks of streamed inputs whose first chunk still waits for admission, by work key
    (at most ``limit`` per key)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._held: dict[str, list[StageInput]] = {}

    def keep(self, key: str, si: StageInput) -> None:
        held = self._held.setdefault(key, [])
        if len(held) < self.limit:
            held.append(si)

    def pop(self, key: str) -> list[StageInput]:
        """The chunks kept for ``key`` (none are kept after)."""
        return self._held.pop(key, [])

    def __contains__(self, key: object) -> bool:
        return key in self._held
