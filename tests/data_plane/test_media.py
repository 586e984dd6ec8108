"""WAV/PCM/PNG encoders of the client API."""

from __future__ import annotations

import base64
import struct
import zlib

import numpy as np
import pytest

from omni_mesh.data_plane.media import (
    PNG_SIGNATURE,
    WAV_UNKNOWN_SIZE,
    b64_wav_seconds,
    join_wavs,
    pcm_bytes,
    png_bytes,
    wav_bytes,
    wav_pcm,
    wav_stream_header,
)
from tests.media_readers import read_png, read_png_size, read_wav

pytestmark = pytest.mark.unit


def test_wav_round_trip() -> None:
    t = np.arange(24_000, dtype=np.float32) / 24_000
    wave = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    data = wav_bytes(wave, 24_000)
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    assert len(data) == 44 + 2 * wave.size
    back, rate = read_wav(data)
    assert rate == 24_000 and back.dtype == np.float32 and back.shape == wave.shape
    np.testing.assert_allclose(back, wave, atol=1.0 / 16_000)


def test_pcm_is_clipped_s16le() -> None:
    wave = np.array([0.0, 1.0, -1.0, 2.0, -3.0, np.nan, 0.5], dtype=np.float32)
    pcm = pcm_bytes(wave)
    assert len(pcm) == 2 * wave.size
    assert struct.unpack("<7h", pcm) == (0, 32767, -32767, 32767, -32767, 0, 16384)


def test_pcm_accepts_and_checks_a_sample_rate() -> None:
    assert pcm_bytes(np.zeros(3, np.float32), 24_000) == bytes(6)
    with pytest.raises(ValueError, match="sample_rate"):
        pcm_bytes(np.zeros(3, np.float32), -1)


def test_int16_waveforms_pass_unchanged() -> None:
    wave = np.array([1, -2, 300], dtype=np.int16)
    assert pcm_bytes(wave) == struct.pack("<3h", 1, -2, 300)


@pytest.mark.parametrize(
    ("bad", "rate"), [(np.zeros((2, 10), np.float32), 24_000), (np.zeros(3, np.float32), 0)]
)
def test_wav_rejects_bad_input(bad: np.ndarray, rate: int) -> None:
    with pytest.raises(ValueError):
        wav_bytes(bad, rate)


@pytest.mark.parametrize("shape", [(17, 23, 3), (5, 4, 4), (9, 2)])
def test_png_round_trip(shape: tuple[int, ...]) -> None:
    image = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
    data = png_bytes(image)
    assert data.startswith(PNG_SIGNATURE)
    assert read_png_size(data) == (shape[1], shape[0])
    assert np.array_equal(read_png(data), image)


def test_png_chunks_carry_valid_crcs() -> None:
    data = png_bytes(np.zeros((4, 4, 3), np.uint8))
    pos, kinds = len(PNG_SIGNATURE), []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        kinds.append(kind)
        pos += 12 + length
    assert kinds == [b"IHDR", b"IDAT", b"IEND"]


@pytest.mark.parametrize(
    "bad",
    [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4, 2), np.uint8), np.zeros((0, 4, 3), np.uint8)],
)
def test_png_rejects_bad_images(bad: np.ndarray) -> None:
    with pytest.raises(ValueError):
        png_bytes(bad)


def test_read_png_size_rejects_other_bytes() -> None:
    with pytest.raises(ValueError, match="not a PNG"):
        read_png_size(b"GIF89a" + bytes(30))


def test_a_streamed_wav_header_has_unknown_sizes_and_reads_back() -> None:
    header = wav_stream_header(24_000)
    assert len(header) == 44
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", header[4:8])[0] == WAV_UNKNOWN_SIZE
    assert header[36:40] == b"data" and struct.unpack("<I", header[40:44])[0] == WAV_UNKNOWN_SIZE
    # The same fmt chunk as a whole file's.
    whole = wav_bytes(np.zeros(10, dtype=np.float32), 24_000)
    assert header[12:36] == whole[12:36]
    wave = np.linspace(-0.5, 0.5, 96, dtype=np.float32)
    back, rate = read_wav(header + pcm_bytes(wave))  # a reader takes the PCM up to EOF
    assert rate == 24_000 and back.shape == wave.shape
    with pytest.raises(ValueError, match="sample_rate"):
        wav_stream_header(0)


def test_join_wavs_copies_the_pcm_of_every_part() -> None:
    waves = [np.linspace(-1, 1, n, dtype=np.float32) for n in (10, 0, 33)]
    joined = join_wavs([wav_bytes(w, 16_000) for w in waves])
    assert joined == wav_bytes(np.concatenate(waves), 16_000)
    assert wav_pcm(joined) == (b"".join(pcm_bytes(w) for w in waves), 16_000)
    with pytest.raises(ValueError, match="sample rate"):
        join_wavs([wav_bytes(waves[0], 16_000), wav_bytes(waves[0], 24_000)])
    with pytest.raises(ValueError, match="no WAV parts"):
        join_wavs([])


def test_a_base64_wav_says_its_duration_from_its_header() -> None:
    half_second = wav_bytes(np.zeros(8000, np.float32), 16000)
    assert b64_wav_seconds(base64.b64encode(half_second).decode()) == pytest.approx(0.5)
    stereo = bytearray(wav_bytes(np.zeros(4000, np.float32), 8000))
    stereo[22:24] = struct.pack("<H", 2)  # the same bytes read as 2 channels: half as long
    assert b64_wav_seconds(base64.b64encode(bytes(stereo)).decode()) == pytest.approx(0.25)
    for other in (b"ID3 an mp3", b"RIFF....AVI LIST", b""):
        assert b64_wav_seconds(base64.b64encode(other).decode()) == 0.0
    assert b64_wav_seconds("not base64 at all!") == 0.0
