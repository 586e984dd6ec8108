"""What the realtime tests send through the SDK's connection: PCM16 audio as base64
``input_audio_buffer.append`` events, in chunks as a microphone would."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

RATE = 24000  # audio/pcm's rate


def b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<i2").tobytes()).decode()


def send_audio(conn: Any, samples: np.ndarray, chunk_ms: int = 100) -> None:
    step = RATE * chunk_ms // 1000
    for i in range(0, len(samples), step):
        conn.input_audio_buffer.append(audio=b64(samples[i : i + step]))
