"""Test audio: real speech made by espeak-ng, silence and seeded noise, as int16 samples."""

from __future__ import annotations

import functools
import io
import shutil
import subprocess
import wave

import numpy as np
import pytest

from omni_mesh.sidecar.api.realtime.audio_formats import resample


@functools.lru_cache(maxsize=64)
def _spoken(text: str, rate: int) -> bytes:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (make test-tools installs it)")
    wav = subprocess.run(
        ["espeak-ng", "--stdout", "-s", "170", text], check=True, capture_output=True, timeout=30
    ).stdout
    with wave.open(io.BytesIO(wav)) as w:
        source_rate = w.getframerate()
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    return resample(samples, source_rate, rate).tobytes()


def speech(text: str, rate: int = 24000) -> np.ndarray:
    """``text`` spoken by espeak-ng, at ``rate``."""
    return np.frombuffer(_spoken(text, rate), np.int16).copy()


def silence(ms: int, rate: int = 24000) -> np.ndarray:
    return np.zeros(ms * rate // 1000, np.int16)


def noise(ms: int, rate: int = 24000, level: float = 300.0, seed: int = 0) -> np.ndarray:
    """White noise of standard deviation ``level`` (of 32768)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.standard_normal(ms * rate // 1000) * level, -32768, 32767).astype(np.int16)
