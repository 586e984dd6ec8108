"""Speech at another speed with its pitch kept: WSOLA (waveform-similarity overlap-add), for
``/v1/audio/speech``'s ``speed`` on any pipeline (the models themselves have no rate input).

The output is built from windowed frames of the input laid down every ``hop`` output samples
(Hann windows at 50% overlap, which sum to one). Frame *k* is read near input sample
``k * hop * speed``: within ``±tolerance`` of there, at the offset whose samples best match
the natural continuation of frame *k - 1* (the most correlated), so the waveform stays
continuous and the pitch is not moved. ``speed`` 2 halves the duration; 1 changes nothing.

:class:`TimeStretcher` works on a stream: :meth:`push` takes the next piece of the input and
returns the output samples that are final, :meth:`finish` the rest. A frame is placed only
once every input sample it may read is there, so the output does not depend on how the input
was cut: pushed in pieces, it is bit for bit the output of one push. The output of an input
of *n* samples has ``round(n / speed)``.
"""

from __future__ import annotations

import numpy as np

#: Frame length (seconds): a few pitch periods of a low voice.
FRAME_S = 0.032


class TimeStretcher:
    """WSOLA over a stream of float samples (module docstring)."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be within [0.25, 4], got {speed}")
        self.speed = speed
        self.hop = max(8, round(FRAME_S * sample_rate) // 2)
        self.frame = 2 * self.hop
        self.tolerance = self.hop // 2
        self._window = np.hanning(self.frame + 1)[:-1].astype(np.float32)  # periodic
        # the first frame has no frame before it to overlap: its first half is kept whole
        self._first = np.concatenate([np.ones(self.hop, np.float32), self._window[self.hop :]])
        self._input = np.zeros(0, np.float32)
        self._base = 0  # input index of self._input[0]
        self._pushed = 0  # input samples received
        self._frames = 0  # frames laid down
        self._prev = 0  # input index of the last frame's start
        self._tail = np.zeros(self.hop, np.float32)  # the last frame's unfinished half
        self._emitted = 0
        self._held = np.zeros(0, np.float32)  # final output past what the input so far makes

    @property
    def identity(self) -> bool:
        return self.speed == 1.0

    def push(self, samples: np.ndarray) -> np.ndarray:
        """The output that is final once ``samples`` follow what came before."""
        x = np.asarray(samples, np.float32).reshape(-1)
        if self.identity:
            self._pushed += len(x)
            self._emitted += len(x)
            return x
        self._input = np.concatenate([self._input, x])
        self._pushed += len(x)
        out: np.ndarray = np.concatenate([self._held, self._lay(final=False)])
        # an output longer than this much input makes is held: the input may end here
        n = max(0, round(self._pushed / self.speed) - self._emitted)
        out, self._held = out[:n], out[n:]
        self._emitted += len(out)
        return out

    def finish(self) -> np.ndarray:
        """The rest of the output: the input is over (zeros after it)."""
        if self.identity:
            return np.zeros(0, np.float32)
        out: np.ndarray = np.concatenate([self._held, self._lay(final=True)])
        self._held = np.zeros(0, np.float32)
        out = out[: max(0, round(self._pushed / self.speed) - self._emitted)]
        self._emitted += len(out)
        return out

    # ---- frames --------------------------------------------------------------------------

    def _lay(self, *, final: bool) -> np.ndarray:
        pieces: list[np.ndarray] = []
        end, total = self._pushed, round(self._pushed / self.speed)
        while True:
            k = self._frames
            nominal = round(k * self.hop * self.speed)
            if final:
                if k * self.hop >= total:
                    break  # the output is long enough: the rest would read only zeros
            elif max(self._prev + self.hop, nominal + self.tolerance) + self.frame > end:
                break  # it may read samples that have not come yet
            start = nominal if k == 0 else self._best(nominal)
            frame = self._read(start) * (self._first if k == 0 else self._window)
            done = self._tail + frame[: self.hop]
            self._tail = frame[self.hop :].copy()
            pieces.append(done)
            self._prev, self._frames = start, k + 1
            self._forget()
        if not pieces:
            return np.zeros(0, np.float32)
        return np.concatenate(pieces)

    def _best(self, nominal: int) -> int:
        """The frame start within ``nominal ± tolerance`` most like the last one's sequel."""
        low = max(0, nominal - self.tolerance)
        high = nominal + self.tolerance
        template = self._read(self._prev + self.hop)
        around = self._read(low, high - low + self.frame)
        scores = np.correlate(around, template, mode="valid")
        return low + int(np.argmax(scores))

    def _read(self, start: int, length: int | None = None) -> np.ndarray:
        """Input samples ``[start, start + length)`` (zeros past what has come)."""
        n = self.frame if length is None else length
        i = start - self._base
        piece = self._input[i : i + n]
        if len(piece) < n:
            piece = np.concatenate([piece, np.zeros(n - len(piece), np.float32)])
        return piece

    def _forget(self) -> None:
        """Drop the input no later frame can read."""
        nominal = round(self._frames * self.hop * self.speed)
        keep_from = min(self._prev + self.hop, nominal - self.tolerance)
        drop = max(0, keep_from - self._base)
        if drop:
            self._input = self._input[drop:]
            self._base += drop


class SpeechPace:
    """One speech answer's audio at the requested ``speed`` (streamed or whole); speed 1
    leaves every sample as it is."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self._stretcher: TimeStretcher | None = None

    def stream(self, waveform: np.ndarray, sample_rate: int) -> np.ndarray:
        """The final samples of the next piece of a streamed answer."""
        if self.speed == 1.0:
            return waveform
        if self._stretcher is None:
            self._stretcher = TimeStretcher(self.speed, sample_rate)
        return self._stretcher.push(as_float(waveform))

    def rest(self) -> np.ndarray:
        """The end of a streamed answer."""
        return np.zeros(0, np.float32) if self._stretcher is None else self._stretcher.finish()

    def whole(self, waveform: np.ndarray, sample_rate: int) -> np.ndarray:
        if self.speed == 1.0:
            return waveform
        stretcher = TimeStretcher(self.speed, sample_rate)
        return np.concatenate([stretcher.push(as_float(waveform)), stretcher.finish()])


def as_float(waveform: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] (an int16 waveform scaled)."""
    if waveform.dtype == np.int16:
        return waveform.astype(np.float32) / 32768.0
    return np.asarray(waveform, np.float32)
