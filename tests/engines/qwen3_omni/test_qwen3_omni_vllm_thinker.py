"""qwen3-omni's thinker on vLLM (``engine_extras.backend: vllm``, issue 33), one engine in this
process: its greedy tokens are transformers' (``Qwen3OmniMoeThinkerForConditionalGeneration
.generate``), and the input embeddings and accept-layer hidden states it hands the talker equal
transformers' ``output_hidden_states`` for the same ids within :data:`TOLERANCE` (fp32; 2e-8
measured), for text and audio prompts, alone and three at once, through chunked prefill (the
engine's token budget is smaller than the prompts) and a forced preemption (a KV cache of 8
blocks for three answers of up to 150 tokens). The talker and code2wav, given its output, give
the monolithic model's codes and samples bit for bit. What the tap needs of vLLM is checked at
start, each setting named."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.engines.base import (
    EngineConfigError,
    EngineContext,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)
from omni_mesh.engines.core import EngineCore
from omni_mesh.engines.qwen3_omni.processors import talker_to_code2wav, thinker_to_talker
from omni_mesh.engines.qwen3_omni.vllm_thinker import Qwen3OmniVllmThinkerEngine
from tests.engines.helpers import make_engine
from tests.engines.qwen3_omni import omni_reference
from tests.engines.qwen3_omni.omni_reference import audio_messages

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
    # vLLM in this process: its own imports touch torch's deprecated names
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

TOLERANCE = 1e-5  # fp32: vLLM's kernels against transformers' (2.2e-8 measured)
TOKENS = 12
BLOCK = 32
TEXT = [{"role": "user", "content": "hello, who are you?"}]
LONG = [
    {"role": "system", "content": "you are a helpful robot that tells long stories"},
    {"role": "user", "content": "tell me a story about the quick brown fox and the lazy dog"},
]
QWEN3_OMNI = get_pipeline("qwen3-omni")


def vllm_thinker(**engine_args: Any) -> StageEngine:
    """Stage 0 of qwen3-omni with backend vllm, picked as the engine process picks it."""
    config = StageDeployConfig(
        stage_id=0,
        max_num_seqs=8,
        max_model_len=256,
        dtype="float32",
        engine_extras={"backend": "vllm", "model": "tiny-qwen3-omni", "max_tokens": TOKENS},
        engine_args={"block_size": BLOCK, **engine_args},
    )
    ctx = EngineContext(QWEN3_OMNI, QWEN3_OMNI.stage(0), config)
    return EngineCore.build(ctx).engine


@pytest.fixture(scope="module", autouse=True)
def _environment_kept() -> Iterator[None]:
    """vLLM, imported in this process, sets variables for the processes it would start
    (``LD_PRELOAD`` of torch's libgomp on CPU): every later test's children would inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def engine(vllm_env: dict[str, str]) -> Iterator[StageEngine]:
    """Chunked prefill (16 tokens a step, the prompts are longer) and a KV cache of 8 blocks
    (and vLLM's null block)."""
    built = vllm_thinker(max_num_batched_tokens=16, num_gpu_blocks_override=9)
    assert isinstance(built, Qwen3OmniVllmThinkerEngine)
    built.load()
    yield built
    built.close()


@pytest.fixture(scope="module")
def monolithic(vllm_env: dict[str, str]) -> Any:
    return omni_reference.monolithic()


def chat(messages: list[dict[str, Any]], **fields: Any) -> StageData:
    return StageData(fields={"messages": json.dumps(messages), "max_tokens": TOKENS, **fields})


def hf_thinker(
    model: Any, messages: list[dict[str, Any]], tokens: int = TOKENS
) -> tuple[np.ndarray, ...]:
    """transformers' greedy thinker: (sequences, input embeddings, accept-layer hidden states)
    of every position it ran."""
    prompt, extra = omni_reference.reference_prompt(model, messages)
    with torch.inference_mode():
        out = model.thinker.generate(
            input_ids=prompt.input_ids,
            attention_mask=prompt.attention_mask,
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=model.config.im_end_token_id,
            output_hidden_states=True,
            return_dict_in_generate=True,
            **extra,
        )
    layer = model.config.talker_config.accept_hidden_layer
    embeds = torch.cat([step[0][0] for step in out.hidden_states]).numpy()
    hidden = torch.cat([step[layer][0] for step in out.hidden_states]).numpy()
    return out.sequences[0].numpy(), embeds, hidden


def assert_same_thought(
    result: EngineResult, model: Any, messages: list[dict[str, Any]], tokens: int = TOKENS
) -> None:
    assert result.error is None, result.error
    sequences, embeds, hidden = hf_thinker(model, messages, tokens)
    arrays = result.output.arrays
    assert np.array_equal(arrays["sequences"], sequences)
    assert arrays["thinker_embed"].shape == embeds.shape == (len(sequences) - 1, 64)
    assert np.abs(arrays["thinker_embed"] - embeds).max() <= TOLERANCE
    assert np.abs(arrays["thinker_hidden"] - hidden).max() <= TOLERANCE
    prompt = int(result.output.fields["prompt_tokens"])  # type: ignore[arg-type]
    text = model.tokenizer.decode(sequences[prompt:], skip_special_tokens=True)
    assert result.final is not None and result.final.fields["text"] == text


class Preemptions:
    """Counts the requests vLLM's scheduler preempted (its outputs say which)."""

    def __init__(self, engine: Any) -> None:
        self.scheduler = engine._llm.engine_core.engine_core.scheduler
        self.schedule = self.scheduler.schedule
        self.preempted = 0

    def __enter__(self) -> Preemptions:
        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = self.schedule(*args, **kwargs)
            self.preempted += len(out.preempted_req_ids or ())
            return out

        self.scheduler.schedule = schedule
        return self

    def __exit__(self, *exc: object) -> None:
        self.scheduler.schedule = self.schedule


@pytest.mark.parametrize("messages", [TEXT, LONG, audio_messages()], ids=["text", "long", "audio"])
def test_tokens_and_hidden_states_equal_transformers(
    engine: StageEngine, monolithic: Any, messages: list[dict[str, Any]]
) -> None:
    (result,) = engine.execute([EngineRequest("r1", 5, chat(messages))])
    assert_same_thought(result, monolithic, messages)
    arrays = result.output.arrays
    assert arrays["tts_special"].shape == (3, 64)
    special = [monolithic.config.tts_bos_token_id, monolithic.config.tts_eos_token_id,
               monolithic.config.tts_pad_token_id]  # fmt: skip
    with torch.inference_mode():
        want = monolithic.thinker.get_input_embeddings()(torch.tensor(special)).numpy()
    assert np.abs(arrays["tts_special"] - want).max() <= TOLERANCE
    if "audio" in json.dumps(messages):
        assert arrays["audio_feature_lengths"].dtype == np.int64
        _, extra = omni_reference.reference_prompt(monolithic, messages)
        lengths = extra["feature_attention_mask"].sum(-1).numpy()
        assert np.array_equal(arrays["audio_feature_lengths"], lengths)


def test_three_at_once_through_a_preemption_each_equal_its_lone_run(
    engine: StageEngine, monolithic: Any
) -> None:
    batch, tokens = [TEXT, audio_messages(), LONG], 150
    with Preemptions(engine) as preempted:
        results = engine.execute(
            [EngineRequest(f"r{i}", 5, chat(m, max_tokens=tokens)) for i, m in enumerate(batch)]
        )
    assert preempted.preempted >= 1  # 8 blocks of 32 tokens for answers of up to 150 tokens
    for result, messages in zip(results, batch, strict=True):
        assert_same_thought(result, monolithic, messages, tokens)


def test_the_talker_and_code2wav_given_its_output_equal_the_monolithic_model(
    engine: StageEngine, monolithic: Any
) -> None:
    frames = 24
    sequences, codes, wav = omni_reference.monolithic_codes(
        monolithic, LONG, seed=5, max_tokens=TOKENS, frames=frames, sample_talker=True
    )
    (thought,) = engine.execute([EngineRequest("r1", 5, chat(LONG))])
    assert np.array_equal(thought.output.arrays["sequences"], sequences)
    talker = make_engine("qwen3-omni", 1, max_frames=frames)
    (spoken,) = talker.execute([EngineRequest("r1", 5, thinker_to_talker(thought.output))])
    assert np.array_equal(spoken.output.arrays["codes"], codes)
    code2wav = make_engine("qwen3-omni", 2)
    (audio,) = code2wav.execute([EngineRequest("r1", 5, talker_to_code2wav(spoken.output))])
    assert audio.final is not None and np.array_equal(audio.final.arrays["waveform"], wav)


def test_streamed_text_then_the_whole_output_for_the_talker(
    engine: StageEngine, monolithic: Any
) -> None:
    results = run_streamed(engine, chat(LONG), 0)
    deltas, whole = results[:-1], results[-1]
    assert len(deltas) >= 2 and all(not r.forward and r.final is not None for r in deltas)
    streamed = "".join(str(r.final.fields["text"]) for r in results if r.final)
    sequences, _, _ = hf_thinker(monolithic, LONG)
    prompt = int(whole.output.fields["prompt_tokens"])  # type: ignore[arg-type]
    want = monolithic.tokenizer.decode(sequences[prompt:], skip_special_tokens=True)
    assert streamed == want
    assert np.array_equal(whole.output.arrays["sequences"], sequences)


def run_streamed(engine: StageEngine, data: StageData, every: int) -> list[EngineResult]:
    """One request's results under ``async_chunk``, its answer handed on every ``every``
    positions (0: whole)."""
    assert isinstance(engine, Qwen3OmniVllmThinkerEngine)
    engine.ctx = dataclasses.replace(engine.ctx, async_chunk=True)
    engine.talker_chunk_tokens = every
    try:
        (stream,) = engine.open([EngineRequest("r1", 5, data)])
        results: list[EngineResult] = []
        while not results or results[-1].last is False:
            engine.before_step(1)
            result = next(stream)
            if result is not None:
                results.append(result)
    finally:
        engine.ctx = dataclasses.replace(engine.ctx, async_chunk=False)
        engine.talker_chunk_tokens = 0
    return results


@pytest.mark.parametrize("messages", [LONG, audio_messages()], ids=["text", "audio"])
def test_the_answer_handed_on_in_chunks_joins_into_the_whole_output(
    engine: StageEngine, messages: list[dict[str, Any]]
) -> None:
    (whole,) = [r for r in run_streamed(engine, chat(messages), 0) if r.forward]
    results = run_streamed(engine, chat(messages), 2)
    chunks = [thinker_to_talker(r.output) for r in results if r.forward]
    assert len(chunks) > 3 and all(r.final is not None for r in results)  # the client's too
    assert chunks[0].arrays["thinker_embed"].shape[0] > chunks[1].arrays["thinker_embed"].shape[0]
    want = thinker_to_talker(whole.output)
    assert chunks[-1].fields == want.fields
    for name, array in want.arrays.items():
        joined = np.concatenate([c.arrays[name] for c in chunks if name in c.arrays])
        assert joined.dtype == array.dtype and np.array_equal(joined, array), name


def test_a_closed_stream_is_aborted_inside_vllm(engine: StageEngine) -> None:
    scheduler = engine._llm.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    (stream,) = engine.open([EngineRequest("r1", 5, chat(LONG, max_tokens=200))])
    for _ in range(3):
        engine.before_step(1)
        next(stream)
    assert sum(scheduler.get_request_counts()) == 1
    stream.close()  # type: ignore[attr-defined]
    assert sum(scheduler.get_request_counts()) == 0


def test_bad_input_fails_its_request_alone(engine: StageEngine, monolithic: Any) -> None:
    good, bad_voice, bad_json = chat(TEXT), chat(TEXT, voice="nobody"), chat(TEXT)
    bad_json.fields["messages"] = "[{"
    results = engine.execute(
        [EngineRequest(f"r{i}", 5, d) for i, d in enumerate((bad_voice, good, bad_json))]
    )
    assert results[0].error is not None and "voice" in results[0].error
    assert results[2].error is not None and "'messages' is not JSON" in results[2].error
    assert_same_thought(results[1], monolithic, TEXT)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
        ({"engine_args": {"enable_prefix_caching": True}}, "engine_args.enable_prefix_caching"),
        ({"engine_args": {"async_scheduling": True}}, "engine_args.async_scheduling"),
        ({"engine_args": {"speculative_config": {"n": 1}}}, "engine_args.speculative_config"),
        ({"engine_args": {"model": "x"}}, "engine_args.model: name the folder"),
        ({"engine_extras": {"backend": "tensorrt"}}, "engine_extras.backend must be one of"),
    ],
)
def test_what_the_tap_cannot_work_with_is_a_config_error_naming_it(
    vllm_env: dict[str, str], settings: dict[str, Any], named: str
) -> None:
    base: dict[str, Any] = {
        "stage_id": 0,
        "engine_extras": {"backend": "vllm", "model": "tiny-qwen3-omni"},
    }
    for key, value in settings.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    if "tensor_parallel_size" in settings:
        base["devices"] = None
    config = StageDeployConfig.model_validate(base)
    ctx = EngineContext(QWEN3_OMNI, QWEN3_OMNI.stage(0), config)
    with pytest.raises(EngineConfigError, match=named):
        EngineCore.build(ctx).engine.load()
