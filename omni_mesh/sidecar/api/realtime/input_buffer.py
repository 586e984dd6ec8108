"""A realtime session's input audio buffer: the int16 samples appended since the last commit,
placed on the session's clock (milliseconds of input audio since the session began). The rate
is the session's input format's, passed in by the caller (a format change clears the buffer)."""

from __future__ import annotations

import numpy as np


class InputBuffer:
    """The uncommitted input audio: :attr:`samples` samples from :attr:`start_ms`."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self.samples = 0
        self.start_ms = 0.0

    def ms(self, rate: int) -> float:
        return self.samples * 1000.0 / rate

    def clear(self, now_ms: float) -> None:
        self._chunks.clear()
        self.samples = 0
        self.start_ms = now_ms

    def append(self, samples: np.ndarray, now_ms: float) -> None:
        """``samples`` received at ``now_ms`` (the clock before them)."""
        if self.samples == 0:
            self.start_ms = now_ms
        self._chunks.append(samples)
        self.samples += len(samples)

    def trim(self, keep_ms: float, rate: int) -> None:
        """Keep about the last ``keep_ms`` (trimmed in steps, not on every append)."""
        keep = int(keep_ms * rate / 1000)
        if self.samples <= 2 * keep:
            return
        samples = self._joined()[-keep:]
        self._chunks = [samples]
        self.start_ms += (self.samples - len(samples)) * 1000.0 / rate
        self.samples = len(samples)

    def take(self, start_ms: float, end_ms: float, rate: int) -> np.ndarray:
        """The samples from ``start_ms`` to ``end_ms``; what came before goes, what comes after
        stays (the start of the next turn)."""
        samples = self._joined()
        a = max(0, int((start_ms - self.start_ms) * rate / 1000))
        b = max(a, min(len(samples), int((end_ms - self.start_ms) * rate / 1000)))
        taken, rest = samples[a:b], samples[b:]
        self._chunks = [rest] if len(rest) else []
        self.start_ms += b * 1000.0 / rate
        self.samples = len(rest)
        return taken

    def _joined(self) -> np.ndarray:
        if len(self._chunks) != 1:
            joined = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
            self._chunks = [joined] if len(joined) else []
        return self._chunks[0] if self._chunks else np.zeros(0, np.int16)
