"""csm-tts's two engines, run stage by stage in-process, against transformers' monolithic
``CsmForConditionalGeneration.generate(..., output_audio=True)`` on the same tiny folder and
prompt: every codec code and every waveform sample are equal (greedy; and sampled from the same
seed), whole and streamed (chunk by chunk with context: codes equal, samples within float
rounding), with two streams interleaved frame by frame (batched, as several requests joining at
different steps and an aborted one are); bad inputs fail their request alone with a message
naming what is wrong."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData, StageEngine
from omni_mesh.engines.csm.processors import talker_to_code2wav
from tests.engines.csm import csm_reference
from tests.engines.helpers import make_engine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

FRAMES = 24  # talker max_frames: an utterance of 24 frames (1.92 s), tiny-csm never ends early
CHUNK = 8
CONTEXT = 12  # < the 16 frames before the third chunk: its context is cut
HOP = 1920  # samples per frame (24 kHz, 12.5 frames/s)
TEXT = "the quick brown fox jumps over the lazy dog"


class Stages:
    def __init__(self) -> None:
        self.greedy = make_engine("csm-tts", 0, do_sample=False, max_frames=FRAMES)
        self.sampled = make_engine(
            "csm-tts",
            0,
            max_frames=FRAMES,
            first_chunk_frames=CHUNK,
            chunk_frames=CHUNK,
            context_frames=CONTEXT,
        )
        self.code2wav = make_engine("csm-tts", 1)

    def streaming(self, engine: StageEngine) -> StageEngine:
        engine.ctx = dataclasses.replace(engine.ctx, async_chunk=True)
        return engine


@pytest.fixture(scope="module")
def stages() -> Stages:
    return Stages()


@pytest.fixture(scope="module")
def sampled_reference() -> tuple[np.ndarray, np.ndarray]:
    return csm_reference.generate(TEXT, speaker=1, seed=11, frames=FRAMES, sampled=True)


def speak(text: str = TEXT, **fields: Any) -> StageData:
    return StageData(fields={"prompt": text, **fields})


def one(engine: StageEngine, data: StageData, seed: int = 5, **kw: Any) -> EngineResult:
    (result,) = engine.execute([EngineRequest("r1", seed, data, **kw)])
    assert result.error is None, result.error
    return result


def waveform(result: EngineResult) -> np.ndarray:
    assert result.final is not None and result.final.fields["sample_rate"] == 24000
    wave: np.ndarray = result.final.arrays["waveform"]
    return wave


def test_greedy_stages_equal_the_monolithic_model(stages: Stages) -> None:
    codes, wav = csm_reference.generate(TEXT, speaker=0, seed=5, frames=FRAMES, sampled=False)
    spoken = one(stages.greedy, speak(voice="default"))
    assert spoken.output.arrays["codes"].shape == (FRAMES, 8)
    assert np.array_equal(spoken.output.arrays["codes"], codes)
    audio = one(stages.code2wav, talker_to_code2wav(spoken.output))
    assert np.array_equal(waveform(audio), wav)  # bit for bit
    assert wav.shape == (FRAMES * HOP,) and wav.dtype == np.float32
    assert 0.05 < float(np.abs(wav).max()) < 1.0  # audible, not clipped
    other = one(stages.greedy, speak(voice="1"))  # the speaker id is part of the prompt
    assert not np.array_equal(other.output.arrays["codes"], codes)


def test_sampled_talker_equals_the_monolithic_model_with_the_same_seed(
    stages: Stages, sampled_reference: tuple[np.ndarray, np.ndarray]
) -> None:
    codes, wav = sampled_reference
    spoken = one(stages.sampled, speak(voice="1"), seed=11)
    assert np.array_equal(spoken.output.arrays["codes"], codes)
    other = one(stages.sampled, speak(voice="1"), seed=12)
    assert not np.array_equal(other.output.arrays["codes"], codes)
    greedy = one(stages.greedy, speak(voice="1"), seed=11)
    assert not np.array_equal(greedy.output.arrays["codes"], codes)  # sampling did something
    audio = one(stages.code2wav, talker_to_code2wav(spoken.output))
    assert np.array_equal(waveform(audio), wav)


def chunks_of(engine: StageEngine, data: StageData, seed: int) -> Iterator[EngineResult]:
    (stream,) = engine.open([EngineRequest("r1", seed, data)])
    for result in stream:
        if result is None:  # a step with no chunk (the talker makes one frame per step)
            continue
        assert result.error is None
        yield result


def test_the_first_chunk_comes_after_first_chunk_frames(
    stages: Stages, sampled_reference: tuple[np.ndarray, np.ndarray]
) -> None:
    codes, _ = sampled_reference
    talker = make_engine("csm-tts", 0, max_frames=FRAMES, chunk_frames=CHUNK)  # first: 2
    talker = stages.streaming(talker)
    chunks = list(chunks_of(talker, speak(voice="1"), 11))
    sizes = [c.output.arrays["codes"].shape[0] for c in chunks]
    assert sizes[0] == 2 and all(n == CHUNK for n in sizes[1:-2])
    assert np.array_equal(np.concatenate([c.output.arrays["codes"] for c in chunks]), codes)


def test_streamed_codes_and_audio_equal_the_whole(
    stages: Stages, sampled_reference: tuple[np.ndarray, np.ndarray]
) -> None:
    codes, wav = sampled_reference
    talker = stages.streaming(stages.sampled)
    chunks = list(chunks_of(talker, speak(voice="1"), 11))
    sizes = [c.output.arrays["codes"].shape[0] for c in chunks]
    assert sizes == [CHUNK, CHUNK, CHUNK]  # the chunk with the last frame is the last
    assert [c.last for c in chunks] == [False, False, True]
    assert [c.output.fields["frame_offset"] for c in chunks] == [0, 8, 16]
    assert np.array_equal(np.concatenate([c.output.arrays["codes"] for c in chunks]), codes)
    assert "context_codes" not in chunks[0].output.arrays
    assert chunks[1].output.arrays["context_codes"].shape == (CHUNK, 8)  # the whole history
    assert chunks[2].output.arrays["context_codes"].shape == (CONTEXT, 8)  # cut to CONTEXT
    pieces = []
    for i, chunk in enumerate(chunks):  # as the core hands code2wav the talker's chunks
        data = talker_to_code2wav(chunk.output)
        pieces.append(waveform(one(stages.code2wav, data, chunk=i, last=chunk.last)))
    assert [len(p) for p in pieces] == [CHUNK * HOP] * 3
    streamed = np.concatenate(pieces)
    assert streamed.shape == wav.shape
    assert float(np.abs(streamed - wav).max()) < 1e-6


def test_interleaved_streams_give_what_each_gives_alone(stages: Stages) -> None:
    data = speak("hello there", max_tokens=10)
    talker = stages.streaming(stages.sampled)
    alone = {seed: one(talker, data, seed).output.arrays["codes"] for seed in (1, 2)}
    streams = talker.open([EngineRequest("a", 1, data), EngineRequest("b", 2, data)])
    got: dict[int, list[np.ndarray]] = {1: [], 2: []}
    open_streams = dict(zip((1, 2), streams, strict=True))
    while open_streams:  # one step of each in turn (a frame), as the core advances them
        for seed, stream in list(open_streams.items()):
            result = next(stream)
            if result is None:
                continue
            assert result.error is None
            got[seed].append(result.output.arrays["codes"])
            if result.last:
                del open_streams[seed]
    for seed in (1, 2):
        assert np.array_equal(np.concatenate(got[seed]), alone[seed])
        assert len(alone[seed]) == 10  # max_tokens caps the frames
    assert not np.array_equal(alone[1], alone[2])


def test_a_closed_stream_stops_its_generation(stages: Stages) -> None:
    talker = stages.streaming(stages.sampled)
    (stream,) = talker.open([EngineRequest("r", 3, speak())])
    first = next(stream)
    while first is None:  # frame by frame up to the first chunk
        first = next(stream)
    assert not first.last
    stream.close()  # type: ignore[attr-defined]  # the core closes aborted streams
    again = one(talker, speak(max_tokens=CHUNK), 3)  # the engine serves on
    assert np.array_equal(again.output.arrays["codes"], first.output.arrays["codes"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": "hi", "voice": "alloy"}, "names unknown voice 'alloy'; allowed: default, 0, 1"),
        ({"prompt": "hi", "voice": "2"}, "names unknown voice '2'; allowed: default, 0, 1"),
        ({"voice": "0"}, "field 'prompt' is required"),
        ({"prompt": 3}, "field 'prompt' must be a string"),
        ({"prompt": "x" * 5000}, "field 'prompt' is 5000 bytes long; the limit is 4096"),
        ({"prompt": "hi", "max_tokens": 5000}, "field 'max_tokens' must be in [1, 24]"),
        ({"prompt": "hi", "max_tokens": "ten"}, "field 'max_tokens' must be an integer"),
    ],
)
def test_bad_talker_input_fails_alone(stages: Stages, fields: dict[str, Any], message: str) -> None:
    good = EngineRequest("good", 1, speak("hello", max_tokens=2))
    bad = EngineRequest("bad", 1, StageData(fields=fields))
    results = {r.request_id: r for r in stages.greedy.execute([bad, good])}
    assert results["good"].error is None
    assert results["good"].output.arrays["codes"].shape == (2, 8)
    error = results["bad"].error
    assert error is not None and message in error and "talker" in error


def test_bad_codes_fail_alone(stages: Stages) -> None:
    codes = np.zeros((5, 8), np.int64)
    bad = [
        (StageData(arrays={"codes": np.zeros((5, 3), np.int64)}), "must have shape (F, 8)"),
        (StageData(arrays={"codes": codes + 64}), "must hold codes in [0, 64)"),
        (StageData(arrays={"codes": codes - 1}), "must hold codes in [0, 64)"),
        (StageData(arrays={"codes": codes.astype(np.int32)}), "must be int64"),
        (StageData(), "array 'codes' is required"),
        (
            StageData(arrays={"codes": codes, "context_codes": np.zeros((2, 4), np.int64)}),
            "array 'context_codes' must have shape (F, 8)",
        ),
    ]
    for data, message in bad:
        good = EngineRequest("good", 1, StageData(arrays={"codes": codes}))
        results = {
            r.request_id: r for r in stages.code2wav.execute([EngineRequest("r", 1, data), good])
        }
        error = results["r"].error
        assert error is not None and message in error and "code2wav" in error, error
        assert len(waveform(results["good"])) == 5 * HOP
    empty = one(stages.code2wav, StageData(arrays={"codes": np.zeros((0, 8), np.int64)}))
    assert len(waveform(empty)) == 0


def test_each_stage_holds_only_its_part(stages: Stages) -> None:
    from transformers import MimiModel

    talker = stages.greedy.model  # type: ignore[attr-defined]
    assert not hasattr(talker, "codec_model")
    assert {"backbone_model", "depth_decoder", "lm_head", "embed_text_tokens"} <= {
        name for name, _ in talker.named_children()
    }
    assert isinstance(stages.code2wav.model, MimiModel)  # type: ignore[attr-defined]


def test_a_decoder_with_an_unfinished_tail_streams_its_whole_decode(
    stages: Stages, sampled_reference: tuple[np.ndarray, np.ndarray]
) -> None:
    """Mimi has no unfinished tail; a decoder whose last 700 samples change once the next frame
    exists (here: faked, they are halved) is measured as such, and its chunks (holding their
    tail back but on the last chunk) still concatenate to its whole decode."""
    import torch

    engine = make_engine("csm-tts", 1)
    real = engine._decode  # type: ignore[attr-defined]

    def unfinished(frames: torch.Tensor) -> torch.Tensor:
        wave = real(frames).clone()
        wave[-700:] *= 0.5
        return wave  # type: ignore[no-any-return]

    engine._decode = unfinished  # type: ignore[attr-defined]
    assert engine._measure() == (HOP, 0, 700)  # type: ignore[attr-defined]
    engine.tail = 700  # type: ignore[attr-defined]
    codes, _ = sampled_reference
    whole = waveform(one(engine, StageData(arrays={"codes": codes})))
    pieces = []
    for i, start in enumerate(range(0, FRAMES + 1, CHUNK)):
        arrays = {"codes": codes[start : start + CHUNK]}
        if start:
            arrays["context_codes"] = codes[max(0, start - CONTEXT) : start]
        last = start + CHUNK > FRAMES
        pieces.append(waveform(one(engine, StageData(arrays=arrays), chunk=i, last=last)))
    assert [len(p) for p in pieces] == [CHUNK * HOP - 700, CHUNK * HOP, CHUNK * HOP, 700]
    streamed = np.concatenate(pieces)
    assert streamed.shape == whole.shape
    assert float(np.abs(streamed - whole).max()) < 1e-6


def test_the_end_frame_ends_the_codes_as_the_monolithic_decode_cuts_them() -> None:
    """tiny-csm never ends early; a real CSM ends on a frame of EOS (0) in every codebook, which
    the monolithic decode drops with everything after it (a frame that is EOS but in its last
    codebook, which stops CSM's generate, is still spoken)."""
    from omni_mesh.engines.csm.talker_batch import ends_utterance, is_end_frame

    codes = np.arange(5 * 8).reshape(5, 8) % 7 + 1
    almost = np.zeros(8, np.int64)
    almost[-1] = 3
    ended = np.concatenate([codes[:3], almost[None], np.zeros((1, 8), np.int64), codes[3:]])
    spoken = []
    for frame in ended:  # as the batch takes a row's frames
        if not is_end_frame(frame, 0):
            spoken.append(frame)
        if ends_utterance(frame, 0):
            break
    assert np.array_equal(np.stack(spoken), ended[:4])
    assert is_end_frame(np.zeros(8, np.int64), 0) and ends_utterance(np.zeros(8, np.int64), 0)
    assert not any(ends_utterance(frame, 0) for frame in codes)
