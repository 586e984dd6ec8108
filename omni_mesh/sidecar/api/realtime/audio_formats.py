"""The Realtime API's audio formats: ``audio/pcm`` (16-bit little-endian mono at 24 kHz),
``audio/pcmu`` (G.711 µ-law, 8 kHz) and ``audio/pcma`` (G.711 A-law, 8 kHz), decoded to and
encoded from int16 samples, and the resampling between them and a model's own rate.

G.711 is computed with 256/65 536-entry tables built once on first use (the ``audioop``
module that did this is gone in Python 3.13). Resampling is linear interpolation, which is
what a voice path at these rates needs; :class:`StreamResampler` carries its phase across
chunks so a stream resampled piece by piece equals the whole resampled at once.
"""

from __future__ import annotations

import functools

import numpy as np

from omni_mesh.data_plane import media

FORMATS: dict[str, int] = {"audio/pcm": 24000, "audio/pcmu": 8000, "audio/pcma": 8000}


class AudioFormatError(ValueError):
    """Audio bytes that are not what their format says (an odd PCM length)."""


def format_rate(fmt: str) -> int:
    """The sample rate ``fmt`` carries (it is fixed per format in the Realtime API)."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise AudioFormatError(f"unknown audio format {fmt!r} (one of {sorted(FORMATS)})") from None


def to_int16(samples: np.ndarray) -> np.ndarray:
    """int16 samples of ``samples`` (int16 as is; float in [-1, 1] scaled and clipped)."""
    arr = np.asarray(samples)
    if arr.dtype == np.int16:
        return arr
    clipped = np.clip(np.nan_to_num(arr.astype(np.float32).ravel(), nan=0.0), -1.0, 1.0)
    return np.round(clipped * 32767.0).astype(np.int16)


def decode(fmt: str, data: bytes) -> np.ndarray:
    """int16 samples at :func:`format_rate` of ``fmt`` from the bytes a client sent."""
    format_rate(fmt)
    if fmt == "audio/pcm":
        if len(data) % 2:
            raise AudioFormatError(
                f"audio/pcm is 16-bit samples: {len(data)} bytes is not a whole number of them"
            )
        return np.frombuffer(data, dtype="<i2").astype(np.int16)
    table = _ulaw_decode() if fmt == "audio/pcmu" else _alaw_decode()
    return table[np.frombuffer(data, dtype=np.uint8)]


def encode(fmt: str, samples: np.ndarray) -> bytes:
    """The bytes of int16 (or float) ``samples`` in ``fmt`` (already at its rate)."""
    format_rate(fmt)
    pcm = to_int16(samples)
    if fmt == "audio/pcm":
        return pcm.astype("<i2", copy=False).tobytes()
    table = _ulaw_encode() if fmt == "audio/pcmu" else _alaw_encode()
    return table[pcm.view(np.uint16)].tobytes()


def resample(samples: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    """``samples`` (int16) at ``rate``; the whole-array form of :class:`StreamResampler`."""
    stream = StreamResampler(source_rate, rate)
    return stream.feed(samples)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """A 16-bit mono WAV file of int16 ``samples`` (what a thinker's ``input_audio`` takes)."""
    return media.wav_bytes(to_int16(samples), rate)


class StreamResampler:
    """Linear-interpolation resampling of a stream fed in pieces of any length; output sample
    ``k`` sits at input position ``k * source_rate / rate`` whatever the piece boundaries."""

    def __init__(self, source_rate: int, rate: int) -> None:
        if source_rate <= 0 or rate <= 0:
            raise ValueError(f"rates must be positive, got {source_rate} -> {rate}")
        self.source_rate, self.rate = source_rate, rate
        self._step = source_rate / rate
        self._emitted = 0  # output samples so far
        self._consumed = 0  # input samples before the held one
        self._held = np.zeros(0, dtype=np.float64)  # the last input sample, for interpolation

    def feed(self, samples: np.ndarray) -> np.ndarray:
        pcm = to_int16(samples)
        if self.source_rate == self.rate:
            return pcm
        x = np.concatenate([self._held, pcm.astype(np.float64)])
        if len(x) == 0:
            return np.zeros(0, dtype=np.int16)
        last = self._consumed + len(x) - 1  # the input position of x's last sample
        # every output sample whose position is at most `last` can be made now
        end = int(np.floor(last / self._step)) + 1
        k = np.arange(self._emitted, max(end, self._emitted), dtype=np.float64)
        positions = k * self._step - self._consumed
        out = np.interp(positions, np.arange(len(x), dtype=np.float64), x)
        self._emitted = max(end, self._emitted)
        self._consumed = last
        self._held = x[-1:]
        result: np.ndarray = np.clip(np.round(out), -32768, 32767).astype(np.int16)
        return result


# G.711 (ITU-T), the segment arithmetic of the classic Sun reference implementation (14-bit
# µ-law, 13-bit A-law input), vectorised: the encode tables are indexed by the sample's bits.
_ULAW_BIAS = 0x84
_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _all_samples() -> np.ndarray:
    """Every int16 value as int64, at the index of its bits read as uint16."""
    return np.arange(65536, dtype=np.int64).astype(np.uint16).view(np.int16).astype(np.int64)


@functools.cache
def _ulaw_encode() -> np.ndarray:
    pcm = _all_samples() >> 2
    negative = pcm < 0
    magnitude = np.minimum(np.where(negative, -pcm, pcm), 8159) + (_ULAW_BIAS >> 2)
    seg = np.searchsorted(_ULAW_SEG_END, magnitude)
    value = (seg << 4) | ((magnitude >> np.minimum(seg + 1, 15)) & 0x0F)
    value = np.where(seg >= 8, 0x7F, value) ^ np.where(negative, 0x7F, 0xFF)
    table: np.ndarray = value.astype(np.uint8)
    return table


@functools.cache
def _alaw_encode() -> np.ndarray:
    pcm = _all_samples() >> 3
    negative = pcm < 0
    pcm = np.where(negative, -pcm - 1, pcm)
    seg = np.searchsorted(_ALAW_SEG_END, pcm)
    value = (seg << 4) | (np.where(seg < 2, pcm >> 1, pcm >> np.minimum(seg, 15)) & 0x0F)
    value = np.where(seg >= 8, 0x7F, value) ^ np.where(negative, 0x55, 0xD5)
    table: np.ndarray = value.astype(np.uint8)
    return table


def _ulaw_sample(byte: int) -> int:
    u = ~byte & 0xFF
    exponent, mantissa = (u >> 4) & 0x07, u & 0x0F
    magnitude = (((mantissa << 3) + _ULAW_BIAS) << exponent) - _ULAW_BIAS
    return -magnitude if u & 0x80 else magnitude


def _alaw_sample(byte: int) -> int:
    a = byte ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    if seg == 0:
        t += 8
    else:
        t = (t + 0x108) << (seg - 1)
    return t if a & 0x80 else -t


@functools.cache
def _ulaw_decode() -> np.ndarray:
    return np.array([_ulaw_sample(b) for b in range(256)], dtype=np.int16)


@functools.cache
def _alaw_decode() -> np.ndarray:
    return np.array([_alaw_sample(b) for b in range(256)], dtype=np.int16)
