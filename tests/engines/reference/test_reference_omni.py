"""tiny-omni and tiny-tts reference engines: shapes, determinism, chains and input validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.engines.base import (
    EngineContext,
    EngineInputError,
    EngineRequest,
    StageData,
    StageEngine,
    import_object,
)
from omni_mesh.engines.reference.code2wav import SAMPLES_PER_FRAME, Code2WavEngine
from omni_mesh.engines.reference.common import VOICES
from omni_mesh.engines.reference.processors import talker_to_code2wav, thinker_to_talker
from omni_mesh.engines.reference.talker import TalkerEngine
from omni_mesh.engines.reference.thinker import HIDDEN, ThinkerEngine
from tests.engines.helpers import make_engine, run_one

pytestmark = pytest.mark.unit

PARAGRAPH = ("The quick brown fox jumps over the lazy dog while the band plays on. " * 9)[:600]


@pytest.fixture(scope="module")
def thinker() -> StageEngine:
    return make_engine("tiny-omni", 0)


@pytest.fixture(scope="module")
def talker() -> StageEngine:
    return make_engine("tiny-omni", 1)


@pytest.fixture(scope="module")
def code2wav() -> StageEngine:
    return make_engine("tiny-omni", 2)


@pytest.fixture(scope="module")
def tts_talker() -> StageEngine:
    return make_engine("tiny-tts", 0)


def test_registered_paths_resolve_to_engines() -> None:
    assert import_object(get_pipeline("tiny-omni").stage(0).engine) is ThinkerEngine
    assert import_object(get_pipeline("tiny-omni").stage(1).engine) is TalkerEngine
    assert import_object(get_pipeline("tiny-tts").stage(1).engine) is Code2WavEngine
    for name in ("tiny-omni", "tiny-tts"):
        for stage in get_pipeline(name).stages:
            if stage.processor:
                assert callable(import_object(stage.processor))


def test_thinker_shapes_for_a_paragraph(thinker: StageEngine) -> None:
    result = run_one(thinker, StageData({"prompt": PARAGRAPH, "voice": "nova", "max_tokens": 8}))
    hidden = result.output.arrays["hidden_states"]
    ids = result.output.arrays["token_ids"]
    assert hidden.dtype == np.float32 and hidden.shape == (608, HIDDEN)
    assert 2_000_000 < hidden.nbytes < 5_000_000
    assert np.isfinite(hidden).all()
    assert ids.dtype == np.int64 and ids.shape == (608,)
    assert bytes(ids[:600].astype(np.uint8)) == PARAGRAPH.encode()
    text = result.output.fields["text"]
    assert isinstance(text, str) and len(text) == 8 and text.isascii() and text.isprintable()
    assert result.final == StageData(fields={"text": text})
    assert result.output.fields["prompt_tokens"] == 600
    assert result.output.fields["generated_tokens"] == 8
    assert result.output.fields["voice"] == "nova"


def test_thinker_kv_cache_matches_full_recompute(thinker: StageEngine) -> None:
    assert isinstance(thinker, ThinkerEngine)
    result = run_one(thinker, StageData({"prompt": "cache check", "max_tokens": 6}))
    ids = torch.from_numpy(result.output.arrays["token_ids"])
    with torch.inference_mode():
        full = thinker.model(ids, 0, thinker.model.blocks.new_caches(len(ids)))
    np.testing.assert_allclose(full.numpy(), result.output.arrays["hidden_states"], atol=1e-4)


def test_thinker_same_seed_same_bytes_other_seed_differs(thinker: StageEngine) -> None:
    data = StageData({"prompt": "Tell me a story.", "max_tokens": 12})
    a, b, c = (run_one(thinker, data, seed=s) for s in (1, 1, 2))
    assert a.output.fields["text"] == b.output.fields["text"]
    for name in ("hidden_states", "token_ids"):
        assert a.output.arrays[name].tobytes() == b.output.arrays[name].tobytes()
    assert a.output.fields["text"] != c.output.fields["text"]


def test_replicas_hold_identical_weights(thinker: StageEngine) -> None:
    replica = make_engine("tiny-omni", 0)
    data = StageData({"prompt": "same weights?", "max_tokens": 4})
    assert (
        run_one(replica, data).output.arrays["hidden_states"].tobytes()
        == run_one(thinker, data).output.arrays["hidden_states"].tobytes()
    )


def test_thinker_max_tokens_and_sampling(thinker: StageEngine) -> None:
    data = StageData({"prompt": "hello", "max_tokens": 10})
    capped = run_one(thinker, data, sampling=SamplingParams(max_tokens=3))
    assert capped.output.fields["generated_tokens"] == 3
    only_sampling = run_one(
        thinker, StageData({"prompt": "hi"}), sampling=SamplingParams(max_tokens=5)
    )
    assert only_sampling.output.fields["generated_tokens"] == 5
    assert run_one(thinker, StageData({"prompt": "hi"})).output.fields["generated_tokens"] == 32
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    texts = {run_one(thinker, data, seed=s, sampling=greedy).output.fields["text"] for s in (1, 2)}
    assert len(texts) == 1


def test_batch_does_not_change_a_requests_output(thinker: StageEngine, talker: StageEngine) -> None:
    target = EngineRequest("target", 42, StageData({"prompt": "batch me", "max_tokens": 6}))
    others = [
        EngineRequest("o1", 1, StageData({"prompt": "another prompt entirely", "max_tokens": 9})),
        EngineRequest("o2", 42, StageData({"prompt": "x", "max_tokens": 3})),
    ]
    alone = thinker.execute([target])[0]
    batched = {r.request_id: r for r in thinker.execute([others[0], target, others[1]])}
    assert batched["target"].output.fields["text"] == alone.output.fields["text"]
    assert (
        batched["target"].output.arrays["hidden_states"].tobytes()
        == alone.output.arrays["hidden_states"].tobytes()
    )
    talk = [
        EngineRequest(r.request_id, s, thinker_to_talker(r.output))
        for r, s in ((alone, 42), (batched["o1"], 1), (batched["o2"], 42))
    ]
    talk_alone = talker.execute([talk[0]])[0].output.arrays["codes"]
    talk_batch = {r.request_id: r for r in talker.execute([talk[1], talk[2], talk[0]])}
    assert talk_batch["target"].output.arrays["codes"].tobytes() == talk_alone.tobytes()


def test_tiny_omni_chain_produces_24khz_audio(
    thinker: StageEngine, talker: StageEngine, code2wav: StageEngine
) -> None:
    first = run_one(thinker, StageData({"prompt": "Say something nice.", "voice": "echo"}))
    talker_input = thinker_to_talker(first.output)
    assert set(talker_input.arrays) == {"hidden_states"}
    assert talker_input.fields == {"text_tokens": 32, "voice": "echo"}
    second = run_one(talker, talker_input)
    codes = second.output.arrays["codes"]
    assert codes.dtype == np.int64 and codes.shape == (64, 4)
    assert codes.min() >= 0 and codes.max() < 1024
    assert second.output.fields == {"num_frames": 64, "voice": "echo"}
    third = run_one(code2wav, talker_to_code2wav(second.output))
    assert third.final is not None
    wave = third.final.arrays["waveform"]
    assert third.final.fields == {"sample_rate": 24_000}
    assert wave.dtype == np.float32 and wave.shape == (64 * SAMPLES_PER_FRAME,)
    assert np.abs(wave).max() < 1.0 and 0.05 < float(np.sqrt(np.mean(wave**2))) < 0.6


def test_talker_voice_and_frame_cap(talker: StageEngine) -> None:
    hidden = np.random.default_rng(0).standard_normal((20, HIDDEN)).astype(np.float32)
    hidden.setflags(write=False)  # as when backed by a received buffer
    data = {
        v: StageData({"text_tokens": 20, "voice": v}, {"hidden_states": hidden}) for v in VOICES[:2]
    }
    a, b = (run_one(talker, d).output.arrays["codes"] for d in data.values())
    assert a.shape == (40, 4) and not np.array_equal(a, b)
    small = make_engine("tiny-omni", 1, max_frames=8)
    assert run_one(small, data[VOICES[0]]).output.arrays["codes"].shape == (8, 4)


def test_tiny_tts_chain(tts_talker: StageEngine, code2wav: StageEngine) -> None:
    prompt = StageData({"prompt": "Hello there", "voice": "alloy"})
    codes = run_one(tts_talker, prompt).output.arrays["codes"]
    assert codes.shape == (22, 4)
    capped = run_one(tts_talker, StageData({"prompt": "Hello there", "max_tokens": 5}))
    assert capped.output.arrays["codes"].shape == (5, 4)
    final = run_one(code2wav, talker_to_code2wav(StageData(arrays={"codes": codes}))).final
    assert final is not None and final.arrays["waveform"].shape == (22 * SAMPLES_PER_FRAME,)
    again = run_one(tts_talker, prompt).output.arrays["codes"]
    assert again.tobytes() == codes.tobytes()


HIDDEN_OK = np.zeros((4, HIDDEN), np.float32)
BAD_INPUTS = [
    ("thinker", StageData({"max_tokens": 3}), "'prompt' is required"),
    ("thinker", StageData({"prompt": 12}), "'prompt' must be a string"),
    ("thinker", StageData({"prompt": ""}), "'prompt' must not be empty"),
    ("thinker", StageData({"prompt": "x" * 5000}), "'prompt' is 5000 bytes"),
    ("thinker", StageData({"prompt": "hi", "max_tokens": 0}), "'max_tokens' must be in"),
    ("thinker", StageData({"prompt": "hi", "max_tokens": 600}), "'max_tokens' is 600"),
    ("thinker", StageData({"prompt": "hi", "max_tokens": "3"}), "'max_tokens' must be an int"),
    ("thinker", StageData({"prompt": "hi", "voice": "bob"}), "'voice' names unknown voice"),
    ("talker", StageData({"voice": "bob"}, {"hidden_states": HIDDEN_OK}), "'voice' names unknown"),
    ("talker", StageData({}), "'hidden_states' is required"),
    (
        "talker",
        StageData(arrays={"hidden_states": HIDDEN_OK[:, :512]}),
        "'hidden_states' must have",
    ),
    (
        "talker",
        StageData(arrays={"hidden_states": HIDDEN_OK.astype(np.float64)}),
        "must be float32",
    ),
    ("talker", StageData(arrays={"hidden_states": HIDDEN_OK * np.nan}), "NaN"),
    ("talker", StageData({"text_tokens": -1}, {"hidden_states": HIDDEN_OK}), "'text_tokens'"),
    ("code2wav", StageData(), "'codes' is required"),
    ("code2wav", StageData(arrays={"codes": np.zeros((3, 2), np.int64)}), "'codes' must have"),
    ("code2wav", StageData(arrays={"codes": np.full((3, 4), 1024)}), "'codes' must hold ids"),
    ("code2wav", StageData(arrays={"codes": np.zeros((3, 4), np.int32)}), "must be int64"),
]


@pytest.mark.parametrize(("stage", "data", "message"), BAD_INPUTS)
def test_bad_inputs_name_stage_and_field(
    stage: str,
    data: StageData,
    message: str,
    thinker: StageEngine,
    talker: StageEngine,
    code2wav: StageEngine,
) -> None:
    engine = {"thinker": thinker, "talker": talker, "code2wav": code2wav}[stage]
    (result,) = engine.execute([EngineRequest("bad-1", 1, data)])
    assert result.request_id == "bad-1" and result.final is None and not result.output.arrays
    assert result.error is not None
    assert f"stage '{stage}'" in result.error and "request 'bad-1'" in result.error
    assert message in result.error


def test_unknown_voice_lists_the_allowed_ones(tts_talker: StageEngine) -> None:
    (result,) = tts_talker.execute(
        [EngineRequest("r", 1, StageData({"prompt": "hi", "voice": "x"}))]
    )
    assert result.error is not None and "'voice' names unknown voice 'x'" in result.error
    assert all(v in result.error for v in VOICES)


def test_a_bad_request_fails_alone_in_its_batch(thinker: StageEngine) -> None:
    good = EngineRequest("good", 1, StageData({"prompt": "fine", "max_tokens": 4}))
    bad = EngineRequest("bad", 1, StageData({"prompt": None}))
    alone = thinker.execute([good])[0]
    results = thinker.execute([bad, good, bad])
    assert [r.request_id for r in results] == ["bad", "good", "bad"]
    assert results[0].error is not None and "'prompt' is required" in results[0].error
    assert results[1].error is None
    assert results[1].output.fields["text"] == alone.output.fields["text"]


def test_processors_reject_missing_outputs() -> None:
    with pytest.raises(EngineInputError, match="hidden_states"):
        thinker_to_talker(StageData({"generated_tokens": 3}))
    with pytest.raises(EngineInputError, match="generated_tokens"):
        thinker_to_talker(StageData(arrays={"hidden_states": HIDDEN_OK}))
    with pytest.raises(EngineInputError, match="codes"):
        talker_to_code2wav(StageData())


def test_execute_before_load_is_an_error() -> None:
    spec = get_pipeline("tiny-omni")
    engine = Code2WavEngine(EngineContext(spec, spec.stage(2), StageDeployConfig(stage_id=2)))
    with pytest.raises(RuntimeError, match="before load"):
        engine.execute([])
    engine.load()
    assert engine.execute([]) == []
    engine.close()
    with pytest.raises(RuntimeError, match="before load"):
        engine.execute([])
