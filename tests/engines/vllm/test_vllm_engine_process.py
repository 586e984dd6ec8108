"""The vLLM engine in real engine processes, through EngineClient. Two engine processes for the
module, started at once (vLLM takes ~10 s to import and start; two imports share the 2 cores):

- ``tiny-llm``'s text engine with ``async_chunk`` on: chunked token streams, determinism per seed,
  continuous batching by vLLM's scheduler (a request added while another runs joins it), abort
  freeing the request inside vLLM, engine stats, and bad input failing as data;
- ``tiny-omni-vllm``'s talker, whole answers (async_chunk off): token ids in (no tokenizer:
  ``skip_tokenizer_init``), one output per request once vLLM finished it, codec frames out to
  code2wav through the processor, deterministic per seed, concurrent requests batched, a bad
  input failing alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import (
    Payload,
    SamplingParams,
    StageInput,
    StageOutput,
    transfer_key,
)
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.sidecar.engine_link.client import EngineClient

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(vllm_env: dict[str, str]) -> AsyncIterator[tuple[EngineClient, EngineClient]]:
    base = load_deploy_config(None, get_pipeline("tiny-llm")).stage(0)
    extras = {**base.engine_extras, "chunk_tokens": 16}  # chunks of 1, 16, 16, … tokens
    update = {"max_model_len": 2048, "max_num_seqs": 8, "engine_extras": extras}
    config = base.model_copy(update=update)
    text_engine = EngineClient("tiny-llm", 0, config, log_level="WARNING", async_chunk=True)
    talker_config = load_deploy_config(None, get_pipeline("tiny-omni-vllm")).stage(1)
    talker_engine = EngineClient(
        "tiny-omni-vllm", 1, talker_config, log_level="WARNING", async_chunk=False
    )
    started = await asyncio.gather(
        text_engine.start(timeout_s=120), talker_engine.start(timeout_s=120), return_exceptions=True
    )
    try:
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        yield text_engine, talker_engine
    finally:
        await asyncio.gather(text_engine.stop(timeout_s=10), talker_engine.stop(timeout_s=10))


@pytest.fixture
def client(engines: tuple[EngineClient, EngineClient]) -> EngineClient:
    return engines[0]


@pytest.fixture
def talker(engines: tuple[EngineClient, EngineClient]) -> EngineClient:
    return engines[1]


def request(
    rid: str,
    *,
    seed: int = 1,
    max_tokens: int = 40,
    prompt: str = "hello world",
    sampling: SamplingParams | None = None,
    token_ids: list[int] | None = None,
) -> StageInput:
    tensors = {}
    if token_ids is not None:
        tensors["token_ids"] = tensor_from_array(np.asarray(token_ids, dtype=np.int64))
    return StageInput(
        pipeline="tiny-llm",
        request_id=rid,
        stage_id=0,
        deadline_ms=int((time.time() + 60) * 1000),
        seed=seed,
        sampling=sampling,
        payload=Payload(fields={"prompt": prompt, "max_tokens": max_tokens}, tensors=tensors),
    )


async def run(
    engine: EngineClient,
    si: StageInput,
    log: list[tuple[str, int, float]] | None = None,
    first: asyncio.Event | None = None,
) -> list[StageOutput]:
    outs = []
    try:
        async for out in engine.stream(si):
            outs.append(out)
            if log is not None:
                log.append((si.request_id, out.chunk, time.monotonic()))
            if first is not None:
                first.set()
    finally:
        engine.release(transfer_key(si))
    return outs


def text(outs: list[StageOutput]) -> str:
    return "".join(str(o.final.fields["text"]) for o in outs if o.final is not None)


async def test_a_request_streams_token_chunks(client: EngineClient) -> None:
    outs = await run(client, request("stream", max_tokens=40))
    assert [o.error for o in outs] == [None] * len(outs)
    assert [(o.chunk, o.last) for o in outs] == [(0, False), (1, False), (2, False), (3, True)]
    counts = [o.final.fields["completion_tokens"] for o in outs[-1:] if o.final is not None]
    assert counts == [40]
    assert outs[-1].final is not None and outs[-1].final.fields["finish_reason"] == "length"
    assert len(text(outs)) > 0


async def test_same_seed_same_tokens_other_seed_other_tokens(client: EngineClient) -> None:
    a, b, c = await asyncio.gather(
        run(client, request("seed-a", seed=11)),
        run(client, request("seed-b", seed=11)),
        run(client, request("seed-c", seed=12)),
    )
    assert text(a) == text(b)
    assert text(a) != text(c)


async def test_temperature_zero_is_greedy_whatever_the_seed(client: EngineClient) -> None:
    greedy = SamplingParams(temperature=0.0)
    a = await run(client, request("greedy-a", seed=1, sampling=greedy))
    b = await run(client, request("greedy-b", seed=2, sampling=greedy))
    assert text(a) == text(b)


async def test_a_new_request_joins_the_running_batch(client: EngineClient) -> None:
    """Continuous batching by vLLM's scheduler, seen in the engine stats (running 2)."""
    log: list[tuple[str, int, float]] = []
    running_seen: list[int] = []
    rates: list[float] = []
    generating = asyncio.Event()
    long = asyncio.create_task(run(client, request("long", max_tokens=1200), log, generating))
    await generating.wait()  # the long request is generating
    short = asyncio.create_task(run(client, request("short", max_tokens=400), log))

    async def watch() -> None:
        while not long.done():
            if client.stats.engine is not None:
                running_seen.append(client.stats.engine.running)
                rates.append(client.stats.engine.tokens_per_s)
            await asyncio.sleep(0.05)

    await asyncio.gather(long, short, watch())
    short_done = max(t for rid, _, t in log if rid == "short")
    long_done = max(t for rid, _, t in log if rid == "long")
    assert short_done < long_done, "the short request waited for the long one"
    assert 2 in running_seen, f"vLLM never ran both at once: {running_seen}"
    assert max(rates) > 0.0  # the stats report vLLM's generation throughput


async def test_abort_frees_the_request_inside_vllm(client: EngineClient) -> None:
    si = request("abort-me", max_tokens=1900)
    chunks = 0
    async for out in client.stream(si):
        assert out.error is None
        chunks += 1
        if chunks == 2:
            break  # leaving the stream aborts the work on the engine
    client.release(transfer_key(si))
    deadline = time.monotonic() + 5
    seen: list[object] = []
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        stats = client.stats.engine
        seen.append(stats)
        if stats is not None and client.stats.running == 0 and stats.running == 0:
            break
    else:
        raise AssertionError(f"the aborted request still runs in vLLM: {seen[-3:]}")
    assert stats.waiting == 0
    assert stats.kv_cache_usage == 0.0


async def test_logprobs_when_asked(client: EngineClient) -> None:
    outs = await run(client, request("lp", max_tokens=8, sampling=SamplingParams(logprobs=0)))
    logprobs = np.concatenate(
        [array_from_tensor(o.final.tensors["logprobs"]) for o in outs if o.final is not None]
    )
    assert logprobs.shape == (8,) and logprobs.dtype == np.float32
    assert np.all(logprobs <= 0.0) and np.all(np.isfinite(logprobs))
    plain = await run(client, request("no-lp", max_tokens=8))
    assert all(o.final is not None and not o.final.tensors for o in plain)


async def test_token_ids_input_and_bad_ids_fail_alone(client: EngineClient) -> None:
    good = await run(client, request("ids", token_ids=[5, 6, 7], max_tokens=4))
    assert good[-1].error is None and good[-1].last
    bad = await run(client, request("bad-ids", token_ids=[5, 99_999], max_tokens=4))
    assert len(bad) == 1 and bad[0].error is not None
    assert bad[0].error.code == "bad_input"
    again = await run(client, request("after-bad", max_tokens=4))
    assert again[-1].error is None


# ---- the talker, whole answers --------------------------------------------------------------


def talker_input(rid: str, ids: np.ndarray, *, seed: int = 1, codes: int = 32) -> StageInput:
    return StageInput(
        pipeline="tiny-omni-vllm",
        request_id=rid,
        stage_id=1,
        from_stage=0,
        deadline_ms=int((time.time() + 60) * 1000),
        seed=seed,
        payload=Payload(
            fields={"max_tokens": codes, "voice": "echo"},
            tensors={"token_ids": tensor_from_array(ids)},
        ),
    )


async def run_whole(engine: EngineClient, si: StageInput) -> list[StageOutput]:
    try:
        return [out async for out in engine.stream(si)]
    finally:
        engine.release(transfer_key(si))


async def frames(engine: EngineClient, si: StageInput) -> np.ndarray:
    (out,) = await run_whole(engine, si)
    assert out.error is None and out.last and out.chunk == 0
    (nxt,) = out.next
    assert nxt.stage_id == 2
    return np.array(array_from_tensor(nxt.payload.tensors["codes"]))


PROMPT = np.array([3, 700, 41, 1000], dtype=np.int64)


async def test_codec_tokens_become_code2wav_frames(talker: EngineClient) -> None:
    codes = await frames(talker, talker_input("frames", PROMPT, codes=32))
    assert codes.shape == (8, 4) and codes.dtype == np.int64
    assert codes.min() >= 0 and codes.max() < 1024


async def test_deterministic_per_seed_and_batched(talker: EngineClient) -> None:
    a, b, c = await asyncio.gather(
        frames(talker, talker_input("seed-a", PROMPT, seed=9)),
        frames(talker, talker_input("seed-b", PROMPT, seed=9)),
        frames(talker, talker_input("seed-c", PROMPT, seed=10)),
    )
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


async def test_a_bad_input_fails_alone(talker: EngineClient) -> None:
    bad = talker_input("bad", np.zeros((2, 2), dtype=np.int64))
    (out,) = await run_whole(talker, bad)
    assert out.error is not None and out.error.code == "bad_input"
    assert "token_ids must be a non-empty 1-D integer array" in out.error.message
    ok = await frames(talker, talker_input("after", PROMPT, codes=8))
    assert ok.shape == (2, 4)
