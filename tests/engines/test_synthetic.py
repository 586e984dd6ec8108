"""The synthetic engine: latency model, output size, determinism, final output."""

from __future__ import annotations

import time

import numpy as np
import pytest

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.engines.base import EngineContext, EngineRequest, StageData
from omni_mesh.engines.synthetic import SyntheticEngine, chunk_bytes, synthetic_bytes

pytestmark = pytest.mark.unit


def make_engine(
    stage_id: int = 0, *, async_chunk: bool = False, **config: float
) -> SyntheticEngine:
    spec = get_pipeline("synthetic")
    config_model = StageDeployConfig(stage_id=stage_id, **config)
    ctx = EngineContext(spec, spec.stage(stage_id), config_model, async_chunk=async_chunk)
    engine = SyntheticEngine(ctx)
    engine.load()
    return engine


def request(
    request_id: str = "r", seed: int = 1, *, chunk: int = 0, last: bool = True, **fields: str | int
) -> EngineRequest:
    return EngineRequest(request_id, seed, StageData(fields=dict(fields)), chunk=chunk, last=last)


def test_one_sleep_per_step_follows_a_plus_b_batch() -> None:
    engine = make_engine(step_latency_ms=20, per_item_latency_ms=5)
    assert engine.step_seconds(4) == pytest.approx(0.040)
    started = time.perf_counter()
    results = engine.execute([request(f"r{i}", i) for i in range(4)])
    assert time.perf_counter() - started >= 0.038
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3"]


def test_no_op_by_default() -> None:
    engine = make_engine()
    started = time.perf_counter()
    (result,) = engine.execute([request()])
    assert time.perf_counter() - started < 0.5
    assert result.output.arrays["data"].shape == (64,)
    assert engine.execute([]) == []


@pytest.mark.parametrize("size", [0, 1, 4096, 10_000, 1 << 20])
def test_output_size_and_dtype(size: int) -> None:
    (result,) = make_engine(output_bytes=size).execute([request()])
    data = result.output.arrays["data"]
    assert data.dtype == np.uint8 and data.shape == (size,)
    assert result.output.nbytes() == size


def test_deterministic_for_the_seed() -> None:
    engine = make_engine(output_bytes=10_000)
    a, b, c = engine.execute([request("a", 5), request("b", 5), request("c", 6)])
    assert a.output.arrays["data"].tobytes() == b.output.arrays["data"].tobytes()
    assert a.output.arrays["data"].tobytes() != c.output.arrays["data"].tobytes()
    other_replica = make_engine(output_bytes=10_000)
    (again,) = other_replica.execute([request("a", 5)])
    assert again.output.arrays["data"].tobytes() == a.output.arrays["data"].tobytes()


def test_fields_pass_through_and_final_only_on_final_stage() -> None:
    (middle,) = make_engine(0).execute([request(prompt="hi", seed_hint=3)])
    assert middle.output.fields == {"prompt": "hi", "seed_hint": 3}
    assert middle.final is None
    (last,) = make_engine(2, output_bytes=100).execute([request()])
    assert last.final is not None
    assert last.final.arrays["data"].tobytes() == last.output.arrays["data"].tobytes()


# ---- streams (async_chunk) -------------------------------------------------------------------


def test_a_whole_input_streams_output_chunks_summing_to_output_bytes() -> None:
    engine = make_engine(2, async_chunk=True, output_bytes=10, output_chunks=4)
    (stream,) = engine.open([request("s", 9, prompt="p")])
    results = list(stream)
    assert [r.last for r in results] == [False, False, False, True]
    sizes = [r.output.arrays["data"].nbytes for r in results]
    assert sizes == [3, 3, 2, 2] and sum(sizes) == 10
    for c, r in enumerate(results):
        data = r.output.arrays["data"]
        assert data.tobytes() == chunk_bytes(9, "synthetic/2", c, sizes[c]).tobytes()
        assert r.final is not None and r.final.arrays["data"] is data  # final stage: the chunk
        assert r.output.fields == {"prompt": "p"}
    assert len({r.output.arrays["data"].tobytes()[:2] for r in results}) == 4  # chunks differ
    (again,) = make_engine(2, async_chunk=True, output_bytes=10, output_chunks=4).open(
        [request("other-id", 9)]
    )
    assert [r.output.arrays["data"].tobytes() for r in again] == [
        r.output.arrays["data"].tobytes() for r in results
    ]


def test_one_chunk_is_the_whole_output_and_no_streaming_without_async_chunk() -> None:
    streamed = make_engine(async_chunk=True, output_bytes=5000)
    (whole,) = make_engine(output_bytes=5000).execute([request(seed=4)])
    (one,) = list(streamed.open([request(seed=4)])[0])
    assert one.last and one.output.arrays["data"].tobytes() == whole.output.arrays["data"].tobytes()
    off = make_engine(output_bytes=5000, output_chunks=8)  # async_chunk off: one output
    (result,) = list(off.open([request(seed=4)])[0])
    assert result.last
    assert (
        result.output.arrays["data"].tobytes() == synthetic_bytes(4, "synthetic/0", 5000).tobytes()
    )


def test_a_chunked_input_gets_one_output_keyed_by_its_chunk() -> None:
    engine = make_engine(1, async_chunk=True, output_bytes=100, output_chunks=4)
    (stream,) = engine.open([request(seed=2, chunk=3, last=False)])
    (result,) = list(stream)
    assert result.last and result.output.arrays["data"].nbytes == 100
    assert result.output.arrays["data"].tobytes() == chunk_bytes(2, "synthetic/1", 3, 100).tobytes()


def test_open_sleeps_nothing_before_step_sleeps_a_plus_b_streams_once() -> None:
    engine = make_engine(step_latency_ms=30, per_item_latency_ms=10, async_chunk=True)
    started = time.perf_counter()
    streams = engine.open([request(f"r{i}") for i in range(3)])
    results = [next(s) for s in streams]
    assert time.perf_counter() - started < 0.02 and len(results) == 3
    started = time.perf_counter()
    engine.before_step(3)
    assert time.perf_counter() - started >= 0.058
