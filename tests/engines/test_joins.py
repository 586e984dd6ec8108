"""A join stage's engine input, in-process through EngineCore: every source's fields and arrays
under ``<source name>.<name>`` without a processor, per-source outputs handed to the join's
processor with one, and a join's processor never applied at its sources."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec, StageSpec
from omni_mesh.configs.registry import register_pipeline
from omni_mesh.data_plane.joins import join_input
from omni_mesh.data_plane.messages import Payload, StageInput, Tensor
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import (
    EngineContext,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)
from omni_mesh.engines.core import EngineCore
from tests.engines.helpers import core_step

pytestmark = pytest.mark.unit

FAR_FUTURE_MS = int((time.time() + 3600) * 1000)
SEEN: list[StageData] = []


class Recorder(StageEngine):
    """Records the data of every request; outputs it unchanged."""

    def load(self) -> None:
        return None

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        SEEN.extend(r.data for r in batch)
        return [EngineResult(r.request_id, output=r.data, final=r.data) for r in batch]


def combine(outputs: Mapping[str, StageData]) -> StageData:
    """A join processor: the sources' names in the order given, and their arrays summed."""
    total = sum(d.arrays["x"] for d in outputs.values())
    assert isinstance(total, np.ndarray)
    return StageData(fields={"order": ",".join(outputs)}, arrays={"sum": total})


def broken(outputs: Mapping[str, StageData]) -> StageData:
    raise RuntimeError("no luck")


def per_source(data: StageData) -> StageData:
    raise AssertionError("a join's processor must not run at its source")


_REC = f"{__name__}:Recorder"


def _pipeline(name: str, processor: str | None) -> PipelineSpec:
    return register_pipeline(
        PipelineSpec(
            name=name,
            stages=(
                StageSpec(stage_id=0, name="a", engine=_REC),
                StageSpec(stage_id=1, name="left", engine=_REC, sources=(0,)),
                StageSpec(stage_id=2, name="right", engine=_REC, sources=(0,)),
                StageSpec(
                    stage_id=3,
                    name="j",
                    engine=_REC,
                    sources=(2, 1),  # source order: right, then left
                    processor=processor,
                    final_output=OutputKind.DATA,
                ),
            ),
        ),
        replace=True,
    )


def _core(spec: PipelineSpec, stage_id: int) -> EngineCore:
    stage = spec.stage(stage_id)
    ctx = EngineContext(spec, stage, StageDeployConfig(stage_id=stage_id))
    return EngineCore(spec, stage, Recorder(ctx))


def _source_input(spec: PipelineSpec, source: int, value: float, rid: str = "r1") -> StageInput:
    x = tensor_from_array(np.full(3, value, dtype=np.float32))
    return StageInput(
        pipeline=spec.name,
        request_id=rid,
        stage_id=3,
        from_stage=source,
        deadline_ms=FAR_FUTURE_MS,
        seed=5,
        payload=Payload(fields={"name": f"from-{source}"}, tensors={"x": x}),
    )


def _write(arr: np.ndarray, owner: str) -> Tensor:
    return tensor_from_array(arr)


def _run(core: EngineCore, si: StageInput) -> EngineResult | str:
    SEEN.clear()
    (out,) = core_step(core, [(si, time.monotonic())], array_from_tensor, _write)
    if out.error is not None:
        return f"{out.error.code}: {out.error.message}"
    return EngineResult(si.request_id)


def test_without_a_processor_the_engine_sees_every_source_by_name() -> None:
    spec = _pipeline("join-plain", None)
    inputs = {1: _source_input(spec, 1, 1.0), 2: _source_input(spec, 2, 2.0)}
    si = join_input(spec, 3, inputs)
    assert si.from_stage == 2 and si.request_id == "r1" and si.seed == 5
    assert list(si.payload.fields) == ["right.name", "left.name"]  # source order
    _run(_core(spec, 3), si)
    (data,) = SEEN
    assert data.fields == {"right.name": "from-2", "left.name": "from-1"}
    assert sorted(data.arrays) == ["left.x", "right.x"]
    assert data.arrays["left.x"].tolist() == [1.0] * 3


def test_a_processor_gets_each_source_and_may_combine_them() -> None:
    spec = _pipeline("join-proc", f"{__name__}:combine")
    si = join_input(spec, 3, {2: _source_input(spec, 2, 2.0), 1: _source_input(spec, 1, 1.0)})
    _run(_core(spec, 3), si)
    (data,) = SEEN
    assert data.fields == {"order": "right,left"}
    assert data.arrays["sum"].tolist() == [3.0] * 3


def test_a_failing_join_processor_fails_the_request_not_the_engine() -> None:
    spec = _pipeline("join-broken", f"{__name__}:broken")
    core = _core(spec, 3)
    si = join_input(spec, 3, {1: _source_input(spec, 1, 1.0), 2: _source_input(spec, 2, 2.0)})
    assert _run(core, si) == ("engine_error: processor for join stage 3: RuntimeError: no luck")
    renamed = StageInput(**{**_fields(si), "payload": Payload(fields={"nosource": 1})})
    result = _run(core, renamed)
    assert isinstance(result, str) and result.startswith("bad_input: stage 3: input 'nosource'")


def test_a_source_does_not_apply_the_joins_processor() -> None:
    spec = _pipeline("join-at-source", f"{__name__}:per_source")
    core = _core(spec, 1)
    si = StageInput(
        pipeline=spec.name,
        request_id="r2",
        stage_id=1,
        from_stage=0,
        deadline_ms=FAR_FUTURE_MS,
        seed=1,
        payload=Payload(fields={"k": "v"}),
    )
    (out,) = core_step(core, [(si, time.monotonic())], array_from_tensor, _write)
    assert out.error is None
    (nxt,) = out.next
    assert (nxt.stage_id, nxt.from_stage, nxt.payload.fields) == (3, 1, {"k": "v"})


def _fields(si: StageInput) -> dict[str, object]:
    return {f: getattr(si, f) for f in si.__struct_fields__}
