"""StageRunner as a join's collector, in-process: the engine and the hops are fakes (the far
side of each boundary). The join is handed off once, with both branches' inputs, whichever
comes first; an input seen again (a replayed branch) is ignored; a branch that fails ends the
request with its error; a branch that ends without its join input is an error, not a silent
half answer. And a source of a join hands its input back up instead of hopping to it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec, StageSpec
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import (
    HopResult,
    Payload,
    StageError,
    StageInput,
    StageOutput,
)
from omni_mesh.sidecar.runner import StageRunner

pytestmark = pytest.mark.timeout(20)

SPEC = get_pipeline("synthetic-diamond")
# A source that is also the collector: 0 -> (1, 2), 1 -> 2; the join 2 takes 0 and 1.
TRIANGLE = PipelineSpec(
    name="join-triangle",
    stages=(
        StageSpec(stage_id=0, name="a", engine="x:Y"),
        StageSpec(stage_id=1, name="b", engine="x:Y", sources=(0,)),
        StageSpec(stage_id=2, name="j", engine="x:Y", sources=(0, 1), final_output=OutputKind.DATA),
    ),
)
DEADLINE_MS = int((time.time() + 3600) * 1000)


def _input(
    stage_id: int, from_stage: int = -1, spec: PipelineSpec = SPEC, **fields: Any
) -> StageInput:
    return StageInput(
        pipeline=spec.name,
        request_id="r",
        stage_id=stage_id,
        from_stage=from_stage,
        deadline_ms=DEADLINE_MS,
        seed=3,
        payload=Payload(fields=dict(fields)),
    )


class FakeEngine:
    """Stage k's engine: one whole output whose next inputs go to every downstream stage."""

    reader: Any = None

    def __init__(self, stage_id: int, spec: PipelineSpec = SPEC) -> None:
        self.stage_id = stage_id
        self.spec = spec

    async def stream(self, si: StageInput) -> AsyncGenerator[StageOutput, None]:
        k, spec = self.stage_id, self.spec
        nexts = [_input(j, k, spec, by=k) for j in spec.downstream(k)]
        yield StageOutput(request_id=si.request_id, stage_id=self.stage_id, next=nexts)

    def release(self, key: str) -> None:
        raise AssertionError("no shared memory here")


class FakeHops:
    """Stages 1 and 2 answer their join input for stage 3 (after ``delay[k]`` s, ``copies[k]``
    times, or an ``error``); stage 3 answers the fields it got."""

    def __init__(
        self,
        delay: dict[int, float] | None = None,
        copies: dict[int, int] | None = None,
        error: int | None = None,
        spec: PipelineSpec = SPEC,
        join: int = 3,
    ) -> None:
        self.spec = spec
        self.join = join
        self.delay = delay or {}
        self.copies = copies or {}
        self.error = error
        self.calls: list[StageInput] = []
        self.cancelled: list[int] = []

    async def stream(self, si: StageInput) -> AsyncGenerator[HopResult, None]:
        self.calls.append(si)
        k = si.stage_id
        if k == self.join:
            yield HopResult(request_id="r", outputs={k: Payload(fields=dict(si.payload.fields))})
            return
        try:
            await asyncio.sleep(self.delay.get(k, 0.0))
        except asyncio.CancelledError:
            self.cancelled.append(k)
            raise
        if k == self.error:
            error = StageError(code="bad_input", message=f"branch {k} failed", stage_id=k)
            yield HopResult(request_id="r", error=error)
            return
        joins = [_input(self.join, k, self.spec, seen=k)] * self.copies.get(k, 1)
        for n in joins[:-1]:
            yield HopResult(request_id="r", joins=[n], more=True)
        yield HopResult(request_id="r", joins=joins[-1:] if joins else [])


async def _frames(stage_id: int, hops: FakeHops) -> list[HopResult]:
    engine = FakeEngine(stage_id, hops.spec)
    runner = StageRunner(hops.spec, stage_id, engine, hops, lambda: "i")  # type: ignore[arg-type]
    first = _input(stage_id, spec=hops.spec)
    async with contextlib.aclosing(runner.run_stream(first)) as frames:
        return [frame async for frame in frames]


def _joined(hops: FakeHops) -> list[StageInput]:
    return [si for si in hops.calls if si.stage_id == hops.join]


@pytest.mark.parametrize("slow", [1, 2])
async def test_the_collector_hands_the_join_off_once_with_both_inputs(slow: int) -> None:
    hops = FakeHops(delay={slow: 0.05})
    frames = await _frames(0, hops)
    (join,) = _joined(hops)
    assert join.payload.fields == {"s1.seen": 1, "s2.seen": 2}  # source order, not arrival
    assert (join.from_stage, join.request_id) == (1, "r")
    outputs = [f.outputs for f in frames if f.outputs]
    assert outputs == [{3: join.payload}]
    assert frames[-1].error is None and not frames[-1].more
    assert all(not f.joins for f in frames)  # nothing left for anyone above


async def test_an_input_seen_again_is_ignored() -> None:
    hops = FakeHops(copies={1: 3}, delay={1: 0.02})  # two copies after the hand-off
    frames = await _frames(0, hops)
    assert len(_joined(hops)) == 1
    assert frames[-1].error is None


async def test_a_failing_branch_ends_the_request_with_its_error() -> None:
    hops = FakeHops(delay={1: 5.0}, error=2)
    frames = await _frames(0, hops)
    error = frames[-1].error
    assert error is not None and (error.code, error.message) == ("bad_input", "branch 2 failed")
    assert _joined(hops) == []
    assert hops.cancelled == [1]  # the other branch's work is abandoned


async def test_a_branch_without_its_join_input_is_an_error() -> None:
    hops = FakeHops(copies={2: 0})
    frames = await _frames(0, hops)
    error = frames[-1].error
    assert error is not None and error.message == "join stage 3 got no input from stage(s) [2]"
    assert _joined(hops) == []


async def test_a_source_of_a_join_hands_its_input_back_up() -> None:
    hops = FakeHops()
    (frame,) = await _frames(1, hops)
    assert hops.calls == []  # no hop to the join
    (n,) = frame.joins
    assert (n.stage_id, n.from_stage, n.payload.fields) == (3, 1, {"by": 1})
    assert not frame.more and frame.timings[0].stage_id == 1


async def test_a_collector_that_is_also_a_source_collects_its_own_input() -> None:
    hops = FakeHops(spec=TRIANGLE, join=2, delay={1: 0.02})
    frames = await _frames(0, hops)
    (join,) = _joined(hops)
    assert join.payload.fields == {"a.by": 0, "b.seen": 1}
    assert [f.outputs for f in frames if f.outputs] == [{2: join.payload}]
    assert [si.stage_id for si in hops.calls] == [1, 2]
