"""Readers of what ``omni_mesh.data_plane.media`` writes (WAV, PNG), for the tests only."""

from __future__ import annotations

import struct
import zlib

import numpy as np

from omni_mesh.data_plane.media import PNG_SIGNATURE, wav_pcm

_PNG_CHANNELS = {0: 1, 2: 3, 6: 4}  # PNG colour type → channels (grey, RGB, RGBA)


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """(float32 waveform in [-1, 1), sample rate) of a 16-bit PCM mono WAV file."""
    frames, rate = wav_pcm(data)
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0, rate


def read_png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def read_png(data: bytes) -> np.ndarray:
    """Decode a PNG written by :func:`png_bytes` (8-bit, non-interlaced, filter type 0 only)."""
    width, height = read_png_size(data)
    pos, idat, channels = len(PNG_SIGNATURE), b"", 0
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            depth, color, _, _, interlace = body[8:13]
            if depth != 8 or color not in _PNG_CHANNELS or interlace:
                raise ValueError("unsupported PNG format")
            channels = _PNG_CHANNELS[color]
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    rows = np.frombuffer(zlib.decompress(idat), dtype=np.uint8)
    rows = rows.reshape(height, 1 + width * channels)
    if rows[:, 0].any():
        raise ValueError("only PNG filter type 0 is supported")
    pixels = rows[:, 1:].reshape(height, width, channels)
    return pixels[:, :, 0] if channels == 1 else pixels
