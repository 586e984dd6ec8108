"""The synthetic engine: latency model, output size, determinism, final output."""

from __future__ import annotations

import time

import numpy as np
import pytest

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.pipeline import get_pipeline
from omni_mesh.engines.base import EngineContext, EngineRequest, StageData
from omni_mesh.engines.synthetic import SyntheticEngine

pytestmark = pytest.mark.unit


def make_engine(stage_id: int = 0, **config: float) -> SyntheticEngine:
    spec = get_pipeline("synthetic")
    ctx = EngineContext(spec, spec.stage(stage_id), StageDeployConfig(stage_id=stage_id, **config))
    engine = SyntheticEngine(ctx)
    engine.load()
    return engine


def request(request_id: str = "r", seed: int = 1, **fields: str | int) -> EngineRequest:
    return EngineRequest(request_id, seed, StageData(fields=dict(fields)))


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
