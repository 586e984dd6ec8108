"""WSOLA time stretching (``/v1/audio/speech``'s ``speed``): the duration scales by 1/speed,
the pitch stays, a stream cut anywhere gives the same samples, and speed 1 is the identity."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from omni_mesh.configs.pipeline_spec import OutputKind
from omni_mesh.data_plane import media
from omni_mesh.sidecar.api.outputs import FinalOutput, OutputChunk
from omni_mesh.sidecar.api.sinks import SpeechAudio, SpeechEvents
from omni_mesh.sidecar.api.time_stretch import TimeStretcher

pytestmark = pytest.mark.unit

RATE = 24000


def tone(freq: float, seconds: float) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def stretched(x: np.ndarray, speed: float, cuts: list[int] | None = None) -> np.ndarray:
    ts = TimeStretcher(speed, RATE)
    pieces = [ts.push(p) for p in np.split(x, cuts or [])]
    return np.concatenate([*pieces, ts.finish()])


def peak_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * RATE / len(x))


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 4.0])
def test_duration_scales_and_pitch_stays(speed: float) -> None:
    x = tone(220.0, 1.0)
    y = stretched(x, speed)
    assert len(y) == round(len(x) / speed)
    assert abs(peak_hz(y) - 220.0) < 3.0  # a resampler would have moved it to 220 x speed
    middle = y[len(y) // 4 : 3 * len(y) // 4]
    assert 0.40 < float(np.abs(middle).max()) < 0.6  # no gaps or doubled frames


def test_a_stream_cut_anywhere_gives_the_same_samples() -> None:
    rng = np.random.default_rng(0)
    x = (tone(180.0, 0.7) + 0.05 * rng.standard_normal(int(RATE * 0.7))).astype(np.float32)
    whole = stretched(x, 1.5)
    for seed in range(3):
        cuts = sorted(np.random.default_rng(seed).choice(len(x), 9, replace=False).tolist())
        assert np.array_equal(stretched(x, 1.5, cuts), whole)
    assert np.array_equal(stretched(x, 1.5, list(range(100, len(x), 100))), whole)


def test_speed_one_changes_nothing() -> None:
    x = tone(300.0, 0.3)
    ts = TimeStretcher(1.0, RATE)
    assert np.array_equal(np.concatenate([ts.push(x[:1000]), ts.push(x[1000:]), ts.finish()]), x)


def test_empty_and_tiny_inputs() -> None:
    assert len(stretched(np.zeros(0, np.float32), 2.0)) == 0
    assert len(stretched(np.ones(10, np.float32), 0.5)) == 20


def test_speed_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="speed"):
        TimeStretcher(5.0, RATE)


def _audio(samples: np.ndarray, chunk: int = 0) -> OutputChunk:
    output = FinalOutput(2, OutputKind.AUDIO, data=b"", fields={"sample_rate": RATE}, array=samples)
    return OutputChunk(2, chunk, output)


def test_the_speech_sinks_stretch_whole_and_streamed_answers_alike() -> None:
    x = tone(200.0, 0.5)
    want = stretched(x, 2.0)
    whole = SpeechAudio(2, "pcm", speed=2.0).unary([_audio(x).output])
    assert np.array_equal(np.frombuffer(whole.body, "<i2"), _int16(want))  # type: ignore[arg-type]
    streamed = SpeechAudio(2, "wav", speed=2.0)
    data = b"".join(streamed.piece(_audio(p, i)) for i, p in enumerate(np.split(x, [3000, 7000])))
    pcm, rate = media.wav_pcm(_sized(data + streamed.tail([])))
    assert rate == RATE and np.array_equal(np.frombuffer(pcm, "<i2"), _int16(want))
    events = SpeechEvents(2, speed=2.0)
    sent = b"".join(events.piece(_audio(p, i)) for i, p in enumerate(np.split(x, [5000])))
    sent += events.tail([])
    deltas = [
        json.loads(line[6:])["audio"]
        for line in sent.decode().splitlines()
        if line.startswith("data: ") and "speech.audio.delta" in line
    ]
    got = np.frombuffer(b"".join(base64.b64decode(d) for d in deltas), "<i2")
    assert np.array_equal(got, _int16(want))
    assert (
        sent.decode()
        .rstrip()
        .endswith(
            '"speech.audio.done","usage":{"input_tokens":0,"output_tokens":0,"total_tokens":0}}'
        )
    )


def _int16(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer(media.pcm_bytes(samples), "<i2")


def _sized(stream: bytes) -> bytes:
    """A streamed WAV (sizes unknown) with its real sizes, for the wave module."""
    n = len(stream) - 44
    return (
        stream[:4]
        + (n + 36).to_bytes(4, "little")
        + stream[8:40]
        + n.to_bytes(4, "little")
        + stream[44:]
    )


def test_the_start_is_not_faded_in() -> None:
    y = stretched(np.full(RATE // 2, 0.5, np.float32), 1.5)
    assert np.allclose(y[: len(y) // 2], 0.5, atol=1e-5)
