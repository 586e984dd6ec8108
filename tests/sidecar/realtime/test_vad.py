"""Server VAD (Silero over ONNX Runtime) on real speech from espeak-ng: one turn per utterance,
its boundaries where the speech is, nothing on noise, the same events however the stream is
cut, at every input rate."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from omni_mesh.sidecar.api.realtime.vad import ServerVad, VadEvent
from tests.sidecar.realtime.speech import noise, silence, speech


def feed(vad: ServerVad, audio: np.ndarray, rate: int, chunk_ms: int) -> list[VadEvent]:
    step = max(1, rate * chunk_ms // 1000)
    events: list[VadEvent] = []
    for i in range(0, len(audio), step):
        events.extend(vad.feed(audio[i : i + step], rate))
    return events


def turn(rate: int = 24000) -> tuple[np.ndarray, int, int]:
    words = speech("hello there, how are you today", rate)
    audio = np.concatenate([silence(700, rate), words, silence(1000, rate)])
    return audio, 700, 700 + len(words) * 1000 // rate


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_one_utterance_is_one_turn_where_the_speech_is(rate: int) -> None:
    audio, start_ms, end_ms = turn(rate)
    vad = ServerVad(silence_duration_ms=500)
    events = feed(vad, audio, rate, 100)
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"], events
    assert abs(events[0].audio_ms - start_ms) <= 150, events
    assert abs(events[1].audio_ms - end_ms) <= 300, events  # espeak's last phoneme fades
    assert not vad.speaking and vad.fed_ms == len(audio) * 1000 // rate


def test_noise_alone_is_no_speech() -> None:
    vad = ServerVad()
    for seed, level in enumerate([100.0, 1000.0, 4000.0]):
        assert feed(vad, noise(2000, 24000, level, seed), 24000, 100) == []


def test_speech_in_noise_is_still_found() -> None:
    audio, start_ms, _ = turn()
    noisy = np.clip(audio.astype(np.int32) + noise(len(audio) * 1000 // 24000 + 1)[: len(audio)],
                    -32768, 32767).astype(np.int16)  # fmt: skip
    events = feed(ServerVad(), noisy, 24000, 100)
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"]
    assert abs(events[0].audio_ms - start_ms) <= 150


def test_the_events_do_not_depend_on_how_the_stream_is_cut() -> None:
    audio, _, _ = turn()
    assert feed(ServerVad(), audio, 24000, 7) == feed(ServerVad(), audio, 24000, 250)


def test_silence_duration_decides_whether_a_pause_ends_the_turn() -> None:
    words = speech("one two", 24000)
    audio = np.concatenate([silence(500), words, silence(400), words, silence(1500)])
    long_wait = feed(ServerVad(silence_duration_ms=800), audio, 24000, 100)
    short_wait = feed(ServerVad(silence_duration_ms=200), audio, 24000, 100)
    assert [e.kind for e in long_wait] == ["speech_started", "speech_stopped"]
    assert [e.kind for e in short_wait] == ["speech_started", "speech_stopped"] * 2


def test_reset_forgets_the_stream() -> None:
    audio, _, _ = turn()
    vad = ServerVad()
    feed(vad, audio[: len(audio) // 2], 24000, 100)
    assert vad.speaking
    vad.reset()
    assert not vad.speaking and vad.fed_ms == 0
    assert [e.kind for e in feed(vad, audio, 24000, 100)] == ["speech_started", "speech_stopped"]


def test_the_vad_does_not_import_torch() -> None:
    import subprocess

    code = (
        "import numpy as np, sys\n"
        "from omni_mesh.sidecar.api.realtime.vad import ServerVad\n"
        "ServerVad().feed(np.zeros(24000, np.int16), 24000)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
