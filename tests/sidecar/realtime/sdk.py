"""What the realtime tests send through the SDK's connection: PCM16 audio as base64
``input_audio_buffer.append`` events, in chunks as a microphone would."""

from __future__ import annotations

import base64
import threading
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed

RATE = 24000  # audio/pcm's rate


def b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<i2").tobytes()).decode()


def send_audio(conn: Any, samples: np.ndarray, chunk_ms: int = 100) -> None:
    step = RATE * chunk_ms // 1000
    for i in range(0, len(samples), step):
        conn.input_audio_buffer.append(audio=b64(samples[i : i + step]))


#: How long :func:`until` waits for its event before it closes the socket and fails (a lost
#: event costs this, not the module's whole timeout).
UNTIL_S = 120.0


def until(conn: Any, kind: str, *, where: Any = None) -> list[Any]:
    """Events up to and including the first of type ``kind`` (that ``where`` accepts)."""
    events: list[Any] = []
    watchdog = threading.Timer(UNTIL_S, conn.close)
    watchdog.start()
    try:
        while True:
            try:
                event = conn.recv()
            except ConnectionClosed:
                if watchdog.is_alive():
                    raise
                seen = [e.type for e in events]
                raise AssertionError(f"no {kind} within {UNTIL_S:.0f} s; got {seen}") from None
            events.append(event)
            assert event.type != "error" or kind == "error", event
            if event.type == kind and (where is None or where(event)):
                return events
    finally:
        watchdog.cancel()
