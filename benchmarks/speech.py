"""A timed ``POST /v1/audio/speech`` client: time to the first audio byte, total time, the PCM.

The body is read with ``resp.content.iter_any()`` (every piece as it arrives). The first audio
byte is the first body byte after the WAV header (its ``data`` chunk header), whether the
server sends the whole file at once (``async_chunk`` off) or streams a WAV of unknown length.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

#: Where a canonical 16-bit PCM WAV header (the only kind the API sends) is searched for ``data``.
MAX_HEADER = 256


@dataclass(frozen=True)
class Speech:
    """One answer: its timings (seconds from sending the request) and its audio."""

    ttfa: float  # first body byte after the WAV header
    total: float  # last body byte
    reads: int  # pieces iter_any() returned
    sample_rate: int
    pcm: bytes  # 16-bit signed little-endian mono

    @property
    def samples(self) -> np.ndarray:
        return np.frombuffer(self.pcm, dtype="<i2")

    @property
    def audio_s(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate if self.sample_rate else 0.0


def header_length(head: bytes) -> int | None:
    """Length of a WAV header up to and including the ``data`` chunk header; None until the
    bytes at hand hold it (RIFF chunks walked from ``fmt``; sizes of 0xFFFFFFFF allowed)."""
    if len(head) < 12:
        return None
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise ValueError(f"not a WAV answer: {head[:16]!r}")
    pos = 12
    while pos + 8 <= len(head):
        kind = head[pos : pos + 4]
        (size,) = struct.unpack("<I", head[pos + 4 : pos + 8])
        if kind == b"data":
            return pos + 8
        pos += 8 + size + (size & 1)
        if pos > MAX_HEADER:
            raise ValueError("no data chunk in the first bytes of the WAV answer")
    return None


def sample_rate_of(head: bytes) -> int:
    """The sample rate in a WAV header's ``fmt`` chunk (the first chunk, as the API writes)."""
    if head[12:16] != b"fmt ":
        raise ValueError("WAV answer without a leading fmt chunk")
    return int(struct.unpack("<I", head[24:28])[0])


async def speak(sess: aiohttp.ClientSession, url: str, model: str, text: str, seed: int) -> Speech:
    """One timed speech request (response_format wav, streamed) to the API server at ``url``."""
    body = {"model": model, "input": text, "response_format": "wav", "seed": seed, "stream": True}
    t0 = time.monotonic()
    buf = bytearray()
    header: int | None = None
    first = 0.0
    reads = 0
    async with sess.post(url + "/v1/audio/speech", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for piece in resp.content.iter_any():
            reads += 1
            buf += piece
            if header is None:
                header = header_length(bytes(buf[:MAX_HEADER]))
            if header is not None and not first and len(buf) > header:
                first = time.monotonic() - t0
    total = time.monotonic() - t0
    if header is None or not first:
        raise RuntimeError(f"speech answer of {len(buf)} bytes holds no audio")
    pcm = bytes(buf[header:])
    if len(pcm) % 2:
        raise RuntimeError(f"speech answer: odd PCM length {len(pcm)}")
    return Speech(first, total, reads, sample_rate_of(bytes(buf[:header])), pcm)


def max_abs_diff(a: Speech, b: Speech) -> tuple[int, int]:
    """(max |a - b| in int16 steps over the common length, difference in sample counts)."""
    x, y = a.samples.astype(np.int32), b.samples.astype(np.int32)
    n = min(len(x), len(y))
    diff = int(np.abs(x[:n] - y[:n]).max()) if n else 0
    return diff, len(x) - len(y)
