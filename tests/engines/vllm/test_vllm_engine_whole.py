"""The vLLM talker of ``tiny-omni-vllm`` in a real engine process, whole answers (async_chunk
off): token ids in (no tokenizer: ``skip_tokenizer_init``), one output per request once vLLM
finished it (its stream yields nothing until then), codec frames out to code2wav through the
processor, deterministic per seed, concurrent requests batched, a bad input failing alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.pipeline import get_pipeline
from omni_mesh.data_plane.messages import Payload, StageInput, StageOutput, transfer_key
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.sidecar.engine_client import EngineClient

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def talker(vllm_env: dict[str, str]) -> AsyncIterator[EngineClient]:
    config = load_deploy_config(None, get_pipeline("tiny-omni-vllm")).stage(1)
    engine = EngineClient("tiny-omni-vllm", 1, config, log_level="WARNING", async_chunk=False)
    await engine.start(timeout_s=90)
    try:
        yield engine
    finally:
        await engine.stop(timeout_s=10)


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


async def run(engine: EngineClient, si: StageInput) -> list[StageOutput]:
    try:
        return [out async for out in engine.stream(si)]
    finally:
        engine.release(transfer_key(si))


async def frames(engine: EngineClient, si: StageInput) -> np.ndarray:
    (out,) = await run(engine, si)
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
    (out,) = await run(talker, bad)
    assert out.error is not None and out.error.code == "bad_input"
    assert "token_ids must be a non-empty 1-D integer array" in out.error.message
    ok = await frames(talker, talker_input("after", PROMPT, codes=8))
    assert ok.shape == (2, 4)
