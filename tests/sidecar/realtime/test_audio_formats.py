"""The Realtime API's audio formats: G.711 µ-law/A-law bit-exact with the ITU reference (as
Python's ``audioop`` computed it, where it still exists), PCM16 framing, and a resampler whose
output does not depend on how the stream was cut into pieces."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from omni_mesh.sidecar.api.realtime import audio_formats as af

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import audioop
    except ImportError:  # Python 3.13+
        audioop = None  # type: ignore[assignment]

EVERY_SAMPLE = np.arange(-32768, 32768, dtype=np.int16)


@pytest.mark.skipif(audioop is None, reason="audioop left Python in 3.13")
@pytest.mark.parametrize(
    ("fmt", "encode", "decode"),
    [("audio/pcmu", "lin2ulaw", "ulaw2lin"), ("audio/pcma", "lin2alaw", "alaw2lin")],
)
def test_g711_equals_the_reference_for_every_sample(fmt: str, encode: str, decode: str) -> None:
    assert af.encode(fmt, EVERY_SAMPLE) == getattr(audioop, encode)(EVERY_SAMPLE.tobytes(), 2)
    every_byte = bytes(range(256))
    assert af.decode(fmt, every_byte).tobytes() == getattr(audioop, decode)(every_byte, 2)


@pytest.mark.parametrize("fmt", ["audio/pcmu", "audio/pcma"])
def test_g711_round_trip_keeps_the_signal(fmt: str) -> None:
    t = np.arange(8000) / 8000
    tone = (np.sin(2 * np.pi * 440 * t) * 12000).astype(np.int16)
    back = af.decode(fmt, af.encode(fmt, tone))
    assert back.dtype == np.int16 and len(back) == len(tone)
    snr = 10 * np.log10(np.sum(tone.astype(float) ** 2) / np.sum((back - tone).astype(float) ** 2))
    assert snr > 30  # G.711 gives ~38 dB on a loud tone


def test_pcm16_is_little_endian_and_whole_samples_only() -> None:
    assert af.decode("audio/pcm", b"\x01\x00\xff\xff").tolist() == [1, -1]
    assert af.encode("audio/pcm", np.array([1, -1], np.int16)) == b"\x01\x00\xff\xff"
    with pytest.raises(af.AudioFormatError, match="3 bytes is not a whole number"):
        af.decode("audio/pcm", b"\x01\x00\x02")
    with pytest.raises(af.AudioFormatError, match="unknown audio format 'audio/opus'"):
        af.decode("audio/opus", b"")
    assert af.format_rate("audio/pcm") == 24000 and af.format_rate("audio/pcmu") == 8000


def test_float_samples_are_clipped_and_scaled() -> None:
    got = af.to_int16(np.array([0.0, 0.5, 1.5, -2.0, np.nan], np.float32))
    assert got.tolist() == [0, 16384, 32767, -32767, 0]


@pytest.mark.parametrize(
    ("src", "dst"), [(24000, 8000), (8000, 24000), (16000, 24000), (24000, 16000), (22050, 24000)]
)
def test_a_stream_resampled_in_pieces_equals_it_resampled_whole(src: int, dst: int) -> None:
    rng = np.random.default_rng(src + dst)
    signal = (rng.standard_normal(20_000) * 3000).astype(np.int16)
    whole = af.resample(signal, src, dst)
    stream = af.StreamResampler(src, dst)
    pieces, i = [], 0
    while i < len(signal):
        n = int(rng.integers(1, 700))
        pieces.append(stream.feed(signal[i : i + n]))
        i += n
    assert np.array_equal(np.concatenate(pieces), whole)
    assert abs(len(whole) - len(signal) * dst / src) <= 2


def test_resampling_keeps_a_tone_at_its_frequency() -> None:
    t = np.arange(24000) / 24000
    tone = (np.sin(2 * np.pi * 300 * t) * 10000).astype(np.int16)
    down = af.resample(tone, 24000, 8000).astype(float)
    peak_hz = np.argmax(np.abs(np.fft.rfft(down))) * 8000 / len(down)
    assert abs(peak_hz - 300) < 2
