"""qwen3-omni's three engines, run stage by stage in-process, against transformers' monolithic
``Qwen3OmniMoeForConditionalGeneration.generate`` on the same tiny folder and prompt: the
thinker's tokens, every codec code and the waveform's samples are equal (greedy; and with the
talker sampled from the same seed), whole and streamed (chunk by chunk with context: codes
equal, samples within float rounding), with audio input, with two streams interleaved step by
step; bad inputs fail their request alone with a message naming what is wrong."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omni_mesh.engines.base import (
    EngineConfigError,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)
from omni_mesh.engines.qwen3_omni.inputs import conversation, thinker_prompt
from omni_mesh.engines.qwen3_omni.processors import talker_to_code2wav, thinker_to_talker
from tests.engines.helpers import make_engine
from tests.engines.qwen3_omni import omni_reference
from tests.engines.qwen3_omni.omni_reference import audio_messages

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(300),
    # the monolithic talker's prompt is embeddings (its repetition penalty sees generated codes)
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

FRAMES = 40  # talker max_frames: 39 frames of codes (the last sampled token has none)
TOKENS = 12


AUDIO_MESSAGES = audio_messages()
TEXT_MESSAGES = [
    {"role": "system", "content": "you are a helpful robot"},
    {"role": "user", "content": "tell me a story about the quick brown fox"},
]


class Stages:
    def __init__(self) -> None:
        self.thinker = make_engine("qwen3-omni", 0)
        self.greedy = make_engine("qwen3-omni", 1, do_sample=False, max_frames=FRAMES)
        self.sampled = make_engine("qwen3-omni", 1, max_frames=FRAMES, chunk_frames=7)
        self.code2wav = make_engine("qwen3-omni", 2)

    def streaming(self, engine: StageEngine) -> StageEngine:
        engine.ctx = dataclasses.replace(engine.ctx, async_chunk=True)
        return engine


@pytest.fixture(scope="module")
def stages() -> Stages:
    return Stages()


@pytest.fixture(scope="module")
def monolithic() -> Any:
    return omni_reference.monolithic()


def one(engine: StageEngine, data: StageData, seed: int = 5) -> EngineResult:
    (result,) = engine.execute([EngineRequest("r1", seed, data)])
    assert result.error is None, result.error
    return result


def reference(
    model: Any, messages: list[dict[str, Any]], *, sample_talker: bool, seed: int = 5
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Monolithic generate: (sequences, codes [F, G], waveform)."""
    return omni_reference.monolithic_codes(
        model, messages, seed=seed, max_tokens=TOKENS, frames=FRAMES, sample_talker=sample_talker
    )


def chat(messages: list[dict[str, Any]], **fields: Any) -> StageData:
    return StageData(fields={"messages": json.dumps(messages), "max_tokens": TOKENS, **fields})


@pytest.mark.parametrize("messages", [TEXT_MESSAGES, AUDIO_MESSAGES], ids=["text", "audio"])
def test_greedy_stages_equal_the_monolithic_model(
    stages: Stages, monolithic: Any, messages: list[dict[str, Any]]
) -> None:
    sequences, codes, wav = reference(monolithic, messages, sample_talker=False)
    thought = one(stages.thinker, chat(messages))
    assert np.array_equal(thought.output.arrays["sequences"], sequences)
    prompt_tokens = thought.output.fields["prompt_tokens"]
    assert isinstance(prompt_tokens, int)
    text = monolithic.tokenizer.decode(sequences[prompt_tokens:], skip_special_tokens=True)
    assert thought.final is not None and thought.final.fields["text"] == text
    spoken = one(stages.greedy, thinker_to_talker(thought.output))
    assert spoken.output.arrays["codes"].shape == (FRAMES - 1, 4)
    assert np.array_equal(spoken.output.arrays["codes"], codes)
    audio = one(stages.code2wav, talker_to_code2wav(spoken.output))
    assert audio.final is not None
    assert np.array_equal(audio.final.arrays["waveform"], wav)  # bit for bit
    assert len(wav) > 1920 * (FRAMES - 2)  # 80 ms of 24 kHz audio per frame


def test_sampled_talker_equals_the_monolithic_model_with_the_same_seed(
    stages: Stages, monolithic: Any
) -> None:
    sequences, codes, wav = reference(monolithic, TEXT_MESSAGES, sample_talker=True, seed=11)
    thought = one(stages.thinker, chat(TEXT_MESSAGES), seed=11)
    assert np.array_equal(thought.output.arrays["sequences"], sequences)
    spoken = one(stages.sampled, thinker_to_talker(thought.output), seed=11)
    assert np.array_equal(spoken.output.arrays["codes"], codes)
    greedy = one(stages.greedy, thinker_to_talker(thought.output))
    assert not np.array_equal(greedy.output.arrays["codes"], codes)  # sampling did something
    other = one(stages.sampled, thinker_to_talker(thought.output), seed=12)
    assert not np.array_equal(other.output.arrays["codes"], codes)
    audio = one(stages.code2wav, talker_to_code2wav(spoken.output))
    assert audio.final is not None and np.array_equal(audio.final.arrays["waveform"], wav)


def test_sampled_thinker_equals_its_generate_with_the_same_seed(
    stages: Stages, monolithic: Any
) -> None:
    from omni_mesh.data_plane.messages import SamplingParams

    prompt = thinker_prompt(
        monolithic.tokenizer,
        monolithic.features,
        conversation("ref", json.dumps(TEXT_MESSAGES), None, 16000),
    )
    torch.manual_seed(21)
    with torch.inference_mode():
        expected = monolithic.thinker.generate(
            input_ids=prompt.input_ids,
            attention_mask=prompt.attention_mask,
            max_new_tokens=TOKENS,
            eos_token_id=monolithic.config.im_end_token_id,
            do_sample=True,
            temperature=1.3,
            top_p=1.0,
            top_k=0,
        )
    sampling = SamplingParams(temperature=1.3)
    (result,) = stages.thinker.execute([EngineRequest("r", 21, chat(TEXT_MESSAGES), sampling)])
    assert result.error is None
    assert np.array_equal(result.output.arrays["sequences"], expected[0].numpy())
    (again,) = stages.thinker.execute([EngineRequest("r", 22, chat(TEXT_MESSAGES), sampling)])
    assert not np.array_equal(again.output.arrays["sequences"], expected[0].numpy())


def chunks_of(engine: StageEngine, data: StageData, seed: int) -> Iterator[EngineResult]:
    (stream,) = engine.open([EngineRequest("r1", seed, data)])
    for result in stream:
        if result is None:  # a step with no chunk (the talker makes one frame per step)
            continue
        assert result.error is None
        yield result


def test_streamed_codes_and_audio_equal_the_whole(stages: Stages, monolithic: Any) -> None:
    _, codes, wav = reference(monolithic, AUDIO_MESSAGES, sample_talker=True, seed=11)
    thought = one(stages.thinker, chat(AUDIO_MESSAGES), seed=11)
    talker = stages.streaming(stages.sampled)
    chunks = list(chunks_of(talker, thinker_to_talker(thought.output), 11))
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    sizes = [len(c.output.arrays["codes"]) for c in chunks]
    assert sizes == [2] + [7] * 5 + [2]  # the first chunk early (2 frames), then 7 a chunk
    assert np.array_equal(np.concatenate([c.output.arrays["codes"] for c in chunks]), codes)
    assert "context_codes" not in chunks[0].output.arrays
    assert chunks[-1].output.arrays["context_codes"].shape == (25, 4)  # code2wav's left context
    pieces = [
        one(stages.code2wav, talker_to_code2wav(c.output)).final.arrays["waveform"]  # type: ignore[union-attr]
        for c in chunks
    ]
    streamed = np.concatenate(pieces)
    assert streamed.shape == wav.shape
    assert float(np.abs(streamed - wav).max()) < 1e-6


def test_streamed_text_comes_token_by_token_and_the_talker_gets_the_whole(
    stages: Stages,
) -> None:
    whole = one(stages.thinker, chat(AUDIO_MESSAGES))
    thinker = make_engine("qwen3-omni", 0)
    thinker.ctx = dataclasses.replace(thinker.ctx, async_chunk=True)
    chunks = list(chunks_of(thinker, chat(AUDIO_MESSAGES), 5))
    assert len(chunks) > 3
    assert all(not c.forward and not c.last and not c.output.arrays for c in chunks[:-1])
    assert chunks[-1].last and chunks[-1].forward
    texts = [str(c.final.fields["text"]) for c in chunks if c.final is not None]
    assert whole.final is not None and "".join(texts) == whole.final.fields["text"]
    for name, arr in whole.output.arrays.items():
        assert np.array_equal(chunks[-1].output.arrays[name], arr), name
    assert chunks[-1].final is not None
    assert chunks[-1].final.fields["completion_tokens"] == TOKENS
    assert chunks[-1].final.fields["finish_reason"] in ("stop", "length")


def test_interleaved_streams_give_what_each_gives_alone(stages: Stages) -> None:
    thought = one(stages.thinker, chat(TEXT_MESSAGES))
    data = thinker_to_talker(thought.output)
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
    assert not np.array_equal(alone[1], alone[2])


def test_a_closed_stream_stops_its_generation(stages: Stages) -> None:
    thought = one(stages.thinker, chat(TEXT_MESSAGES))
    talker = stages.streaming(stages.sampled)
    (stream,) = talker.open([EngineRequest("r", 3, thinker_to_talker(thought.output))])
    first = next(stream)
    while first is None:  # frame by frame up to the first chunk
        first = next(stream)
    assert not first.last
    stream.close()  # type: ignore[attr-defined]  # the core closes aborted streams
    again = one(talker, thinker_to_talker(thought.output), 3)  # the engine serves on
    assert np.array_equal(again.output.arrays["codes"][:2], first.output.arrays["codes"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": "hi", "voice": "alloy"}, "unknown voice 'alloy'; allowed: default, aiden"),
        ({"messages": "not json"}, "field 'messages' is not JSON"),
        (
            {"messages": json.dumps([{"role": "robot", "content": "x"}])},
            "messages[0]: needs a role",
        ),
        (
            {
                "messages": json.dumps(
                    [{"role": "user", "content": [{"type": "input_audio",
                                                   "input_audio": {"data": "@@"}}]}]
                )
            },
            "messages[0].content[0]: input_audio data is not base64",
        ),
        (
            {
                "messages": json.dumps(
                    [{"role": "user", "content": [{"type": "input_audio",
                                                   "input_audio": {"data": "aGVsbG8="}}]}]
                )
            },
            "input_audio is not a PCM WAV file",
        ),
        ({"prompt": "hi", "max_tokens": 5000}, "this stage generates at most 1024"),
        (
            {"messages": json.dumps(
                [{"role": "user", "content": [{"type": "input_audio",
                                               "input_audio": {"data": omni_reference.wav_b64(
                                                   omni_reference.TONE[:100], 16000)}}]}]
            )},
            "holds 100 samples at 16000 Hz; the audio encoder needs at least 400",
        ),
    ],
)  # fmt: skip
def test_bad_thinker_input_fails_alone(
    stages: Stages, fields: dict[str, Any], message: str
) -> None:
    good = EngineRequest("good", 1, StageData(fields={"prompt": "hello", "max_tokens": 3}))
    bad = EngineRequest("bad", 1, StageData(fields=fields))
    results = {r.request_id: r for r in stages.thinker.execute([bad, good])}
    assert results["good"].error is None
    error = results["bad"].error
    assert error is not None and message in error and "thinker" in error


def test_bad_codes_fail_alone(stages: Stages) -> None:
    codes = np.zeros((5, 4), np.int64)
    bad = [
        (StageData(arrays={"codes": np.zeros((5, 3), np.int64)}), "must have shape (F, 4)"),
        (StageData(arrays={"codes": codes + 64}), "must hold codes in [0, 64)"),
        (StageData(arrays={"codes": codes.astype(np.int32)}), "must be int64"),
        (StageData(), "array 'codes' is required"),
    ]
    for data, message in bad:
        (result,) = stages.code2wav.execute([EngineRequest("r", 1, data)])
        assert result.error is not None and message in result.error
    ok = one(stages.code2wav, StageData(arrays={"codes": codes}))
    assert ok.final is not None and ok.final.arrays["waveform"].dtype == np.float32


def test_bad_talker_input_names_the_array(stages: Stages) -> None:
    thought = one(stages.thinker, chat(TEXT_MESSAGES))
    data = thinker_to_talker(thought.output)
    del data.arrays["thinker_hidden"]
    (result,) = stages.greedy.execute([EngineRequest("r", 1, data)])
    assert result.error is not None and "array 'thinker_hidden' is required" in result.error


@pytest.mark.parametrize(
    ("stage", "extras", "message"),
    [
        (0, {"model": "/no/such/folder"}, "neither a tiny model"),
        (1, {"do_sample": "yes"}, "engine_extras.do_sample must be true or false"),
        (1, {"chunk_frames": 0}, "engine_extras.chunk_frames must be an integer in [1, 4096]"),
        (2, {"model": 7}, "engine_extras.model must be a model name or folder"),
    ],
)
def test_bad_engine_settings_are_config_errors(
    stage: int, extras: dict[str, Any], message: str
) -> None:
    with pytest.raises(EngineConfigError, match=re.escape(message)):
        make_engine("qwen3-omni", stage, **extras)


def test_a_one_token_answer_is_spoken_as_no_audio(stages: Stages) -> None:
    # The monolithic generate fails on it (no first answer token for the talker's prompt).
    thought = one(stages.thinker, StageData(fields={"prompt": "hi", "max_tokens": 1}))
    for talker in (stages.greedy, stages.streaming(stages.sampled)):
        chunks = list(chunks_of(talker, thinker_to_talker(thought.output), 1))
        assert len(chunks) == 1 and chunks[0].last
        assert chunks[0].output.arrays["codes"].shape == (0, 4)
        audio = one(stages.code2wav, talker_to_code2wav(chunks[0].output))
        assert audio.final is not None and audio.final.arrays["waveform"].shape == (0,)


def test_a_folder_without_the_part_is_a_config_error() -> None:
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from omni_mesh.engines.hf.common import load_part
    from omni_mesh.engines.hf.folders import resolve_folder

    folder = resolve_folder("tiny-qwen3-omni")
    config = Qwen3OmniMoeConfig.from_pretrained(str(folder)).code2wav_config
    with pytest.raises(EngineConfigError, match=r"lacks \d+ tensor\(s\) of its .vocoder. part"):
        load_part(Qwen3OmniMoeCode2Wav, folder, config, "vocoder")


def test_code2wav_decodes_a_batch_together_as_each_alone(stages: Stages) -> None:
    rng = np.random.default_rng(3)
    datas = [StageData(arrays={"codes": rng.integers(0, 64, (n, 4))}) for n in (5, 17, 40)] + [
        StageData(
            arrays={
                "codes": rng.integers(0, 64, (10, 4)),
                "context_codes": rng.integers(0, 64, (25, 4)),
            }
        ),
        StageData(arrays={"codes": np.zeros((3, 4), np.int32)}),  # bad: fails alone
    ]
    alone = [
        stages.code2wav.execute([EngineRequest(f"r{i}", 1, d)])[0] for i, d in enumerate(datas)
    ]
    forwards: list[int] = []
    hook = stages.code2wav.model.register_forward_hook(  # type: ignore[attr-defined]
        lambda module, args, output: forwards.append(args[0].shape[0])
    )
    try:
        together = stages.code2wav.execute(
            [EngineRequest(f"r{i}", 1, d) for i, d in enumerate(datas)]
        )
    finally:
        hook.remove()
    assert forwards == [4]  # one forward over the four good rows
    assert [r.request_id for r in together] == [f"r{i}" for i in range(5)]
    assert together[4].error is not None and alone[4].error is not None
    for got, want in zip(together[:4], alone[:4], strict=True):
        assert got.final is not None and want.final is not None
        a, b = got.final.arrays["waveform"], want.final.arrays["waveform"]
        assert a.shape == b.shape and float(np.abs(a - b).max()) < 1e-5
    assert together[3].final is not None
    assert together[3].final.arrays["waveform"].shape == (10 * 1920,)
