"""Media encoders for the client API (stdlib + numpy only): WAV and raw PCM audio, PNG images.

Float waveforms are clipped to [-1, 1] and written as 16-bit signed little-endian PCM. The PNG
encoder writes 8-bit RGB/RGBA/grey, filter type 0, zlib-compressed — enough for model outputs
without Pillow (the tests read them back with ``tests/media_readers.py``).
A streamed WAV is :func:`wav_stream_header` followed by PCM as it is produced; chunked audio is
joined with :func:`join_wavs` (the PCM of every part, in order, under one header).
"""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib
from collections.abc import Sequence

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_COLOR_TYPES = {1: 0, 3: 2, 4: 6}  # channels → PNG colour type (grey, RGB, RGBA)
MAX_SAMPLE_RATE = 384_000


def _to_int16(waveform: np.ndarray) -> np.ndarray:
    arr = np.asarray(waveform)
    if arr.ndim != 1:
        raise ValueError(f"waveform must be 1-D (mono), got shape {arr.shape}")
    if arr.dtype == np.int16:
        return arr.astype("<i2", copy=False)
    if arr.dtype.kind != "f":
        raise ValueError(f"waveform must be float (or int16), got {arr.dtype}")
    clipped = np.clip(np.nan_to_num(arr.astype(np.float32), nan=0.0), -1.0, 1.0)
    return np.round(clipped * 32767.0).astype("<i2")


def pcm_bytes(waveform: np.ndarray, sample_rate: int | None = None) -> bytes:
    """Raw 16-bit signed little-endian mono PCM (``audio/pcm``, no header). ``sample_rate`` is
    accepted for symmetry with :func:`wav_bytes` and only checked: raw PCM does not carry it."""
    if sample_rate is not None:
        _check_rate(sample_rate)
    return _to_int16(waveform).tobytes()


def _check_rate(sample_rate: int) -> None:
    if not 1 <= sample_rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"sample_rate must be in [1, {MAX_SAMPLE_RATE}], got {sample_rate}")


def wav_bytes(waveform: np.ndarray, sample_rate: int) -> bytes:
    """A 16-bit PCM mono WAV file of ``waveform`` (float in [-1, 1], or int16)."""
    return _wav_file(pcm_bytes(waveform), sample_rate)


def _wav_file(pcm: bytes, sample_rate: int) -> bytes:
    """A 16-bit mono WAV file holding ``pcm``."""
    _check_rate(sample_rate)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(sample_rate)
        writer.writeframes(pcm)
    return buffer.getvalue()


#: The size fields of a WAV whose length is not known when its header is sent (streaming).
WAV_UNKNOWN_SIZE = 0xFFFFFFFF


def wav_stream_header(sample_rate: int) -> bytes:
    """The 44-byte header of a 16-bit PCM mono WAV of unknown length: the RIFF and data sizes
    are ``0xFFFFFFFF``, as streaming TTS servers send them; the PCM follows as it is made."""
    _check_rate(sample_rate)
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)
    return b"".join(
        (
            b"RIFF",
            struct.pack("<I", WAV_UNKNOWN_SIZE),
            b"WAVE",
            b"fmt ",
            struct.pack("<I", len(fmt)),
            fmt,
            b"data",
            struct.pack("<I", WAV_UNKNOWN_SIZE),
        )
    )


def wav_pcm(data: bytes) -> tuple[bytes, int]:
    """(raw 16-bit PCM frames, sample rate) of a 16-bit PCM mono WAV file."""
    with wave.open(io.BytesIO(data), "rb") as reader:
        if reader.getnchannels() != 1 or reader.getsampwidth() != 2:
            raise ValueError("only 16-bit mono WAV is supported")
        return reader.readframes(reader.getnframes()), reader.getframerate()


def join_wavs(parts: Sequence[bytes]) -> bytes:
    """One WAV holding the PCM of every part in order (the same sample rate throughout);
    the PCM is copied, not re-quantised, so the bytes match a WAV of the whole waveform."""
    if not parts:
        raise ValueError("no WAV parts to join")
    pcm: list[bytes] = []
    rate = 0
    for i, part in enumerate(parts):
        frames, part_rate = wav_pcm(part)
        if rate and part_rate != rate:
            raise ValueError(f"WAV part {i} has sample rate {part_rate}, the first {rate}")
        rate = part_rate
        pcm.append(frames)
    return _wav_file(b"".join(pcm), rate)


def _chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(body, zlib.crc32(kind))
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def png_bytes(image: np.ndarray, compression: int = 6) -> bytes:
    """A PNG file of ``image``: uint8 [H, W, 3] (RGB), [H, W, 4] (RGBA) or [H, W] (grey)."""
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        raise ValueError(f"image must be uint8, got {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in _PNG_COLOR_TYPES or 0 in arr.shape[:2]:
        raise ValueError(f"image must be [H, W], [H, W, 3] or [H, W, 4], got {image.shape}")
    height, width, channels = arr.shape
    rows = np.zeros((height, 1 + width * channels), dtype=np.uint8)  # column 0: filter type 0
    rows[:, 1:] = arr.reshape(height, width * channels)
    header = struct.pack(">IIBBBBB", width, height, 8, _PNG_COLOR_TYPES[channels], 0, 0, 0)
    return b"".join(
        (
            PNG_SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(rows.tobytes(), compression)),
            _chunk(b"IEND", b""),
        )
    )


def b64_wav_seconds(data: str) -> float:
    """The duration of a base64 WAV (a client's input audio) read from its header and its
    length, without decoding it: 0.0 for anything that is not a PCM WAV with the canonical
    44-byte header (the duration is approximate for WAVs with extra chunks)."""
    try:
        head = base64.b64decode(data[:64], validate=False)
    except ValueError:
        return 0.0
    if len(head) < 44 or head[:4] != b"RIFF" or head[8:12] != b"WAVE" or head[12:16] != b"fmt ":
        return 0.0
    channels, rate = (int(v) for v in struct.unpack_from("<HI", head, 22))
    bits = int(struct.unpack_from("<H", head, 34)[0])
    frame = channels * max(1, bits // 8)
    if not rate or not frame:
        return 0.0
    size = len(data.rstrip("=")) * 3 // 4 - 44
    return max(0, size) / (rate * frame)
