"""Streaming reference engines (async_chunk): the talker's chunks are its whole codes, byte for
byte, and code2wav's causal decoder turns chunks with their context into the whole waveform.

``CONTEXT_FRAMES`` is proved here both ways: with it a chunk decodes exactly as within the whole
sequence, with one frame less it measurably does not.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Payload, StageInput, Tensor
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import (
    EngineContext,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
    import_object,
)
from omni_mesh.engines.core import EngineCore
from omni_mesh.engines.reference.code2wav import Code2WavEngine, receptive_field_frames
from omni_mesh.engines.reference.codec import CONTEXT_FRAMES, SAMPLES_PER_FRAME
from omni_mesh.engines.reference.processors import talker_to_code2wav
from omni_mesh.engines.reference.thinker import HIDDEN
from tests.engines.helpers import core_step, make_engine, run_one

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPT = "Streaming speech, chunk by chunk."  # 33 bytes: 66 frames


def streaming_engine(pipeline: str, stage_id: int, **extras: Any) -> StageEngine:
    spec = get_pipeline(pipeline)
    config = StageDeployConfig(stage_id=stage_id, engine_extras=extras)
    ctx = EngineContext(spec, spec.stage(stage_id), config, async_chunk=True)
    engine: StageEngine = import_object(spec.stage(stage_id).engine)(ctx)
    engine.load()
    return engine


def drain(engine: StageEngine, request: EngineRequest) -> list[EngineResult]:
    (stream,) = engine.open([request])
    results = list(stream)
    assert all(r.error is None for r in results), results[0].error
    return results


@pytest.fixture(scope="module")
def code2wav() -> Code2WavEngine:
    engine = make_engine("tiny-tts", 1)
    assert isinstance(engine, Code2WavEngine)
    return engine


@pytest.fixture(scope="module")
def codes() -> np.ndarray:
    """66 frames from the real talker (not uniform noise)."""
    talker = make_engine("tiny-tts", 0)
    return run_one(talker, StageData({"prompt": PROMPT}), seed=11).output.arrays["codes"]


# ---- talker ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_frames", [1, 7, 10, 66, 1024])
def test_talker_chunks_are_the_whole_codes_byte_for_byte(
    chunk_frames: int, codes: np.ndarray
) -> None:
    talker = streaming_engine("tiny-tts", 0, chunk_frames=chunk_frames)
    request = EngineRequest("t", 11, StageData({"prompt": PROMPT}))
    results = drain(talker, request)
    n = -(-66 // chunk_frames)
    assert len(results) == n and [r.last for r in results] == [False] * (n - 1) + [True]
    assert np.concatenate([r.output.arrays["codes"] for r in results]).tobytes() == codes.tobytes()
    offset = 0
    for r in results:
        chunk = r.output.arrays["codes"]
        assert r.output.fields == {
            "num_frames": len(chunk),
            "voice": "default",
            "frame_offset": offset,
        }
        if offset == 0:
            assert "context_codes" not in r.output.arrays
        else:
            context = r.output.arrays["context_codes"]
            assert context.tobytes() == codes[max(0, offset - CONTEXT_FRAMES) : offset].tobytes()
        offset += len(chunk)
    assert offset == 66


def test_talker_after_the_thinker_streams_the_same_codes_too() -> None:
    hidden = np.random.default_rng(1).standard_normal((12, HIDDEN)).astype(np.float32)
    data = StageData({"text_tokens": 12, "voice": "nova"}, {"hidden_states": hidden})
    whole = run_one(make_engine("tiny-omni", 1), data, seed=5).output.arrays["codes"]
    results = drain(streaming_engine("tiny-omni", 1), EngineRequest("t", 5, data))
    assert [len(r.output.arrays["codes"]) for r in results] == [10, 10, 4]
    assert np.concatenate([r.output.arrays["codes"] for r in results]).tobytes() == whole.tobytes()


def test_talker_streams_only_a_whole_input_with_async_chunk() -> None:
    streaming = streaming_engine("tiny-tts", 0, chunk_frames=4)
    chunked = EngineRequest("c", 1, StageData({"prompt": "hello"}), chunk=2, last=False)
    (one,) = drain(streaming, chunked)
    assert one.last and one.output.arrays["codes"].shape == (10, 4)
    (single,) = drain(
        make_engine("tiny-tts", 0, chunk_frames=4), EngineRequest("w", 1, chunked.data)
    )
    assert single.last and single.output.arrays["codes"].shape == (10, 4)


@pytest.mark.parametrize("bad", [0, 1025, "10"])
def test_chunk_frames_is_checked_at_load(bad: object) -> None:
    with pytest.raises(ValueError, match="chunk_frames"):
        streaming_engine("tiny-tts", 0, chunk_frames=bad)


def test_a_bad_request_gets_an_error_stream_at_once() -> None:
    talker = streaming_engine("tiny-tts", 0)
    bad, good = talker.open(
        [
            EngineRequest("bad", 1, StageData({"prompt": "hi", "voice": "kazoo"})),
            EngineRequest("good", 1, StageData({"prompt": "hi"})),
        ]
    )
    (error,) = list(bad)
    assert error.error is not None and "'voice'" in error.error
    assert next(good).error is None


# ---- code2wav --------------------------------------------------------------------------------


def decode_in_chunks(code2wav: Code2WavEngine, codes: np.ndarray, size: int) -> np.ndarray:
    """Each chunk through the engine's own input path, with its context like the talker's."""
    waves = []
    for start in range(0, len(codes), size):
        arrays = {"codes": codes[start : start + size]}
        if start:
            arrays["context_codes"] = codes[max(0, start - CONTEXT_FRAMES) : start]
        final = run_one(code2wav, talker_to_code2wav(StageData(arrays=arrays))).final
        assert final is not None
        waves.append(final.arrays["waveform"])
    return np.concatenate(waves)


@pytest.mark.parametrize("size", [1, 3, 10, 16, 65])
def test_chunked_decode_equals_whole_decode(
    code2wav: Code2WavEngine, codes: np.ndarray, size: int
) -> None:
    whole = code2wav.decode(codes)
    chunked = decode_in_chunks(code2wav, codes, size)
    assert chunked.shape == whole.shape == (66 * SAMPLES_PER_FRAME,)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4)


def test_waveform_is_bounded_audible_and_deterministic(
    code2wav: Code2WavEngine, codes: np.ndarray
) -> None:
    wave = code2wav.decode(codes)
    assert wave.dtype == np.float32 and np.isfinite(wave).all()
    assert np.abs(wave).max() < 1.0
    rms = float(np.sqrt(np.mean(wave**2)))
    assert 0.1 < rms < 0.5, rms
    assert abs(float(wave.mean())) < 0.1
    assert code2wav.decode(codes).tobytes() == wave.tobytes()
    replica = make_engine("tiny-tts", 1)
    assert isinstance(replica, Code2WavEngine)
    assert replica.decode(codes).tobytes() == wave.tobytes()
    assert (replica.offset, replica.gain) == (code2wav.offset, code2wav.gain)


def test_context_frames_is_exactly_the_receptive_field(
    code2wav: Code2WavEngine, codes: np.ndarray
) -> None:
    assert receptive_field_frames() == CONTEXT_FRAMES == 9
    start, size = 30, 10
    whole = code2wav.decode(codes)[start * SAMPLES_PER_FRAME : (start + size) * SAMPLES_PER_FRAME]
    chunk = codes[start : start + size]

    def error_with(context: int) -> float:
        return float(np.abs(code2wav.decode(chunk, codes[start - context : start]) - whole).max())

    assert error_with(CONTEXT_FRAMES) < 1e-5
    assert error_with(CONTEXT_FRAMES + 5) < 1e-5  # more context changes nothing
    assert error_with(CONTEXT_FRAMES - 1) > 1e-3  # one frame less is audibly wrong


def test_processor_passes_context_codes_when_present() -> None:
    codes, context = np.zeros((2, 4), np.int64), np.ones((3, 4), np.int64)
    both = talker_to_code2wav(StageData({"x": 1}, {"codes": codes, "context_codes": context}))
    assert set(both.arrays) == {"codes", "context_codes"} and both.fields == {}
    assert both.arrays["context_codes"] is context
    assert set(talker_to_code2wav(StageData(arrays={"codes": codes})).arrays) == {"codes"}


def test_code2wav_rejects_a_bad_context(code2wav: Code2WavEngine) -> None:
    codes = np.zeros((2, 4), np.int64)
    data = StageData(arrays={"codes": codes, "context_codes": np.zeros((2, 3), np.int64)})
    (result,) = code2wav.execute([EngineRequest("bad", 1, data)])
    assert result.error is not None and "'context_codes' must have shape" in result.error


# ---- through the engine cores: tiny-tts streamed end to end ----------------------------------


def core(stage_id: int, *, async_chunk: bool, **extras: Any) -> EngineCore:
    spec = get_pipeline("tiny-tts")
    config = StageDeployConfig(stage_id=stage_id, engine_extras=extras)
    built = EngineCore.build(
        EngineContext(spec, spec.stage(stage_id), config, async_chunk=async_chunk)
    )
    built.engine.load()
    return built


def write(arr: np.ndarray, owner: str) -> Tensor:
    return tensor_from_array(np.array(arr, copy=True))


def run_step(c: EngineCore, inputs: list[StageInput]) -> list[Any]:
    now = time.monotonic()
    return core_step(c, [(x, now) for x in inputs], array_from_tensor, write)


def test_tiny_tts_streamed_through_engine_cores_gives_the_whole_audio() -> None:
    prompt = StageInput(
        pipeline="tiny-tts",
        request_id="tts",
        stage_id=0,
        deadline_ms=int((time.time() + 600) * 1000),
        seed=3,
        payload=Payload(fields={"prompt": "Chunked hello!", "max_tokens": 25}),
    )
    # Whole mode: one output per stage.
    (talked,) = run_step(core(0, async_chunk=False), [prompt])
    (spoken,) = run_step(core(1, async_chunk=False), talked.next)
    expected = array_from_tensor(spoken.final.tensors["waveform"])
    # Streamed: the talker yields 3 chunks over 3 steps; each hop goes to code2wav at once.
    talker, decoder = core(0, async_chunk=True, chunk_frames=10), core(1, async_chunk=True)
    pieces, hops = [], []
    outs = run_step(talker, [prompt])
    while outs:
        (out,) = outs
        (hop,) = out.next
        hops.append((hop.chunk, hop.last))
        (audio,) = run_step(decoder, [hop])
        assert (audio.error, audio.chunk, audio.last) == (None, hop.chunk, hop.last)
        pieces.append(array_from_tensor(audio.final.tensors["waveform"]))
        outs = run_step(talker, [])
    assert hops == [(0, False), (1, False), (2, True)]
    assert [len(p) // SAMPLES_PER_FRAME for p in pieces] == [10, 10, 5]
    np.testing.assert_allclose(np.concatenate(pieces), expected, rtol=0, atol=1e-4)
    assert talker.running == 0 and decoder.running == 0
