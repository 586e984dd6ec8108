"""FrameMerger: frames of several producer tasks passed on as they arrive (chain.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from omni_mesh.data_plane.messages import HopResult, Payload, StageError, StageTiming
from omni_mesh.sidecar.runner import FrameMerger

pytestmark = pytest.mark.timeout(20)


def frame(stage: int, chunk: int, *, timing: str | None = None) -> HopResult:
    timings = [StageTiming(stage, timing, 1.0, 0.0, 1.0)] if timing else []
    return HopResult(
        request_id="r",
        outputs={stage: Payload(fields={"c": chunk})},
        chunks={stage: chunk},
        timings=timings,
        more=False,
    )


async def test_frames_pass_in_arrival_order_and_timings_are_kept_for_the_end() -> None:
    release = asyncio.Event()

    async def slow(merger: FrameMerger) -> None:
        await release.wait()
        merger.put(frame(2, 0, timing="slow"))

    async def fast(merger: FrameMerger) -> None:
        merger.put(frame(2, 1, timing="fast"))
        release.set()

    async with FrameMerger("r") as merger:
        merger.spawn(slow(merger))
        merger.spawn(fast(merger))
        got = [f async for f in merger.frames()]
    assert [f.chunks[2] for f in got] == [1, 0]
    assert all(f.more and not f.timings for f in got)  # passed on as "more to come"
    assert sorted(t.instance_id for t in merger.timings) == ["fast", "slow"]
    assert not merger.failed


async def test_the_first_error_ends_the_merge_and_cancels_the_rest() -> None:
    cancelled = asyncio.Event()

    async def forever(merger: FrameMerger) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    async def failing(merger: FrameMerger) -> None:
        merger.put(frame(1, 0))
        error = StageError(code="bad_input", message="no", stage_id=1)
        merger.put(HopResult(request_id="r", error=error, more=True))

    async with FrameMerger("r") as merger:
        merger.spawn(forever(merger))
        merger.spawn(failing(merger))
        got = [f async for f in merger.frames()]
    assert got[-1].error is not None and got[-1].error.code == "bad_input"
    assert not got[-1].more  # an error frame is the last
    assert merger.failed and cancelled.is_set()


async def test_a_producer_that_raises_ends_the_merge_with_its_exception() -> None:
    """A producer that raises (this stage's engine died) cannot be answered as a frame: the
    consumer gets the exception (and cuts its stream, so that the sender replays it)."""
    cancelled = asyncio.Event()

    async def broken(merger: FrameMerger) -> None:
        merger.put(frame(2, 0))
        await asyncio.sleep(0.01)
        raise RuntimeError("boom")

    async def slow(merger: FrameMerger) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    got: list[HopResult] = []
    with pytest.raises(RuntimeError, match="boom"):
        async with FrameMerger("r") as merger:
            merger.spawn(broken(merger))
            merger.spawn(slow(merger))
            async for f in merger.frames():
                got.append(f)
    assert [f.chunks[2] for f in got] == [0]
    assert merger.failed and cancelled.is_set()


async def test_producers_spawned_by_producers_are_waited_for() -> None:
    async def child(merger: FrameMerger, chunk: int) -> None:
        await asyncio.sleep(0.01 * chunk)
        merger.put(frame(3, chunk))

    async def parent(merger: FrameMerger) -> None:
        for chunk in range(3):
            merger.spawn(child(merger, chunk))
            await asyncio.sleep(0)

    async with FrameMerger("r") as merger:
        merger.spawn(parent(merger))
        got = [f async for f in merger.frames()]
    assert sorted(f.chunks[3] for f in got) == [0, 1, 2]


async def test_leaving_early_cancels_every_producer() -> None:
    started = asyncio.Event()
    ended: list[str] = []

    async def producer(merger: FrameMerger) -> None:
        merger.put(frame(1, 0))
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async with FrameMerger("r") as merger:
        merger.spawn(producer(merger))
        async with contextlib.aclosing(merger.frames()) as frames:
            await anext(frames)
    assert ended == ["cancelled"]
