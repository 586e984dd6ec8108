"""EngineCore streams (async_chunk): chunks over steps, the chunk numbering rule, continuous
batching of running streams, and every way a stream can end early (abort, deadline, errors).

A scripted streaming engine yields one result per ``next()``; the real synthetic engine checks
the same through its own streams.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import msgspec
import numpy as np
import pytest

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Payload, StageInput, StageOutput
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import (
    EngineContext,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)
from omni_mesh.engines.core import EngineCore
from omni_mesh.engines.synthetic import chunk_bytes
from tests.engines.helpers import core_step

pytestmark = pytest.mark.unit

SYNTHETIC = get_pipeline("synthetic")
FAR_FUTURE_MS = int((time.time() + 3600) * 1000)


class ChunkyEngine(StageEngine):
    """Streams ``fields["chunks"]`` results for a whole input (``fields["per_chunk"]``, default
    1, for a chunk of an upstream stream), one per ``next()``. ``raise_at`` / ``stop_at`` make
    the stream raise, or stop without a last result, at that result index; ``hold`` is a bit
    mask of the result indexes given ``forward=False`` (for the client alone). Records the
    closed streams and the size of every step."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.closed: list[str] = []
        self.steps: list[int] = []

    def load(self) -> None:
        pass

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        return [next(stream) for stream in self.open(batch)]

    def open(self, batch: Sequence[EngineRequest]) -> list[Iterator[EngineResult]]:
        return [self._stream(request) for request in batch]

    def before_step(self, streams: int) -> None:
        self.steps.append(streams)

    def _stream(self, request: EngineRequest) -> Iterator[EngineResult]:
        fields = request.data.fields
        n = fields.get("chunks", 1) if request.whole else fields.get("per_chunk", 1)
        assert isinstance(n, int)
        try:
            for i in range(n):
                if fields.get("raise_at") == i:
                    raise RuntimeError(f"boom at {i}")
                if fields.get("stop_at") == i:
                    return
                data = np.full(8, 10 * request.chunk + i, dtype=np.uint8)
                output = StageData(fields={"i": i}, arrays={"data": data})
                hold_mask = fields.get("hold", 0)
                assert isinstance(hold_mask, int)
                hold = bool(hold_mask >> i & 1)
                yield EngineResult(
                    request.request_id, output=output, last=i == n - 1, forward=not hold
                )
        finally:
            self.closed.append(request.request_id)


def chunky_core() -> tuple[EngineCore, ChunkyEngine]:
    stage = SYNTHETIC.stage(1)
    engine = ChunkyEngine(EngineContext(SYNTHETIC, stage, StageDeployConfig(stage_id=1)))
    return EngineCore(SYNTHETIC, stage, engine), engine


def synthetic_core(stage_id: int, **config: float) -> EngineCore:
    ctx = EngineContext(
        SYNTHETIC,
        SYNTHETIC.stage(stage_id),
        StageDeployConfig(stage_id=stage_id, **config),
        async_chunk=True,
    )
    core = EngineCore.build(ctx)
    core.engine.load()
    return core


def si(
    request_id: str,
    stage_id: int = 1,
    *,
    chunk: int = 0,
    last: bool = True,
    deadline_ms: int = FAR_FUTURE_MS,
    seed: int = 7,
    **fields: int,
) -> StageInput:
    return StageInput(
        pipeline=SYNTHETIC.name,
        request_id=request_id,
        stage_id=stage_id,
        from_stage=stage_id - 1,
        chunk=chunk,
        last=last,
        deadline_ms=deadline_ms,
        seed=seed,
        payload=Payload(fields=dict(fields)),
    )


def write(arr: np.ndarray, owner: str) -> object:
    return tensor_from_array(np.array(arr, copy=True))


def step(core: EngineCore, *inputs: StageInput, enqueued: float | None = None) -> list[StageOutput]:
    now = time.monotonic() if enqueued is None else enqueued
    return core_step(core, [(x, now) for x in inputs], array_from_tensor, write)  # type: ignore[arg-type]


def shape(outs: list[StageOutput]) -> list[tuple[str, int, bool]]:
    """(request, chunk, last) of each output, with ``!`` on the request id of an error."""
    return [(o.request_id + ("!" if o.error else ""), o.chunk, o.last) for o in outs]


# ---- chunks over steps -----------------------------------------------------------------------


def test_a_whole_input_streams_one_chunk_per_step() -> None:
    core, engine = chunky_core()
    outs = [step(core, si("a", chunks=3))]
    assert core.running == 1
    outs += [step(core), step(core)]
    assert [shape(o) for o in outs] == [[("a", 0, False)], [("a", 1, False)], [("a", 2, True)]]
    assert core.running == 0 and step(core) == []
    for c, (out,) in enumerate(outs):
        (nxt,) = out.next
        assert (nxt.stage_id, nxt.chunk, nxt.last) == (2, c, c == 2)
        assert nxt.payload.fields == {"i": c}
        assert array_from_tensor(nxt.payload.tensors["data"]).tolist() == [c] * 8
    assert engine.closed == ["a"] and engine.steps == [1, 1, 1]


def test_held_chunks_build_no_next_input_and_the_next_stage_numbers_its_own() -> None:
    # Results 0 and 2 are for the client alone (a thinker's text); 1 and 3 go on, numbered
    # 0 and 1 for the next stage; the output chunks keep their own numbers.
    core, _ = chunky_core()
    outs = [step(core, si("a", chunks=4, hold=0b0101))] + [step(core) for _ in range(3)]
    assert [shape(o) for o in outs] == [[("a", c, c == 3)] for c in range(4)]
    nexts = [[(n.chunk, n.last, n.payload.fields["i"]) for n in out.next] for (out,) in outs]
    assert nexts == [[], [(0, False, 1)], [], [(1, True, 3)]]
    # Holding every result but the last hands the next stage one whole input.
    core, _ = chunky_core()
    outs = [step(core, si("b", chunks=3, hold=0b111))] + [step(core) for _ in range(2)]
    assert [[(n.chunk, n.last) for n in out.next] for (out,) in outs] == [[], [], [(0, True)]]


def test_inputs_go_only_towards_the_final_stages_the_client_wants() -> None:
    core = synthetic_core(0)
    wanted = msgspec.structs.replace(si("a", stage_id=0), final_stages=(2,))
    (out,) = step(core, wanted)
    assert [(n.stage_id, n.final_stages) for n in out.next] == [(1, (2,))]  # s1 leads to s2
    core = synthetic_core(1)
    (out,) = step(core, msgspec.structs.replace(si("b"), final_stages=(1,)))
    assert out.error is None and out.next == []  # nothing wanted after s1
    (out,) = step(core, si("c"))
    assert [n.stage_id for n in out.next] == [2]  # () wants every final output


def test_new_requests_join_the_running_streams() -> None:
    core, engine = chunky_core()
    assert shape(step(core, si("a", chunks=3))) == [("a", 0, False)]
    assert shape(step(core, si("b", chunks=2), si("c"))) == [
        ("a", 1, False),
        ("b", 0, False),
        ("c", 0, True),  # a whole output: answered in the step that admits it
    ]
    assert core.running == 2
    assert shape(step(core)) == [("a", 2, True), ("b", 1, True)]
    assert engine.steps == [1, 3, 2] and core.running == 0


def test_queue_time_goes_on_the_first_chunk_engine_time_on_every_chunk() -> None:
    core = synthetic_core(0, step_latency_ms=20, output_chunks=2)
    (first,) = step(core, si("q", 0), enqueued=time.monotonic() - 0.2)
    (second,) = step(core)
    assert first.queue_ms >= 200.0 and second.queue_ms == 0.0
    assert first.engine_ms >= 19.0 and second.engine_ms >= 19.0


class SlowChunkyEngine(ChunkyEngine):
    """A ChunkyEngine whose every step takes 10 ms."""

    def before_step(self, streams: int) -> None:
        super().before_step(streams)
        time.sleep(0.01)


def test_a_steps_time_is_shared_among_the_requests_it_advanced() -> None:
    stage = SYNTHETIC.stage(1)
    engine = SlowChunkyEngine(EngineContext(SYNTHETIC, stage, StageDeployConfig(stage_id=1)))
    core = EngineCore(SYNTHETIC, stage, engine)
    t0 = time.monotonic()
    (a0,) = step(core, si("a", chunks=3))  # a alone
    a1, b0 = step(core, si("b"))  # a and b: the step's time halved
    (a2,) = step(core)  # a alone again
    wall_ms = (time.monotonic() - t0) * 1000.0
    assert a1.used_ms == pytest.approx(b0.used_ms)
    assert a0.used_ms >= 10.0 and a2.used_ms >= 10.0 and b0.used_ms >= 5.0
    assert a0.used_ms > 1.5 * a1.used_ms
    total = a0.used_ms + a1.used_ms + b0.used_ms + a2.used_ms
    assert 30.0 <= total <= wall_ms  # every step's whole time, shared, nothing counted twice


# ---- the chunk numbering rule ----------------------------------------------------------------


@pytest.mark.parametrize(("chunk", "last"), [(4, False), (5, True), (0, False)])
def test_a_chunked_input_gets_one_output_with_its_chunk(chunk: int, last: bool) -> None:
    core, _ = chunky_core()
    (out,) = step(core, si("c", chunk=chunk, last=last, chunks=3))  # chunks: only if whole
    assert (out.error, out.chunk, out.last) == (None, chunk, last)
    (nxt,) = out.next
    assert (nxt.chunk, nxt.last) == (chunk, last)
    assert array_from_tensor(nxt.payload.tensors["data"]).tolist() == [10 * chunk] * 8
    assert core.running == 0


def test_several_results_for_a_chunked_input_is_an_engine_error() -> None:
    core, engine = chunky_core()
    (out,) = step(core, si("c", chunk=2, last=False, per_chunk=2))
    assert out.error is not None and out.error.code == "engine_error"
    assert "more than one result for chunk 2" in out.error.message
    assert (out.chunk, out.last) == (2, True) and core.running == 0
    assert engine.closed == ["c"]


def test_chunks_of_one_request_in_one_batch_keep_their_order() -> None:
    core = synthetic_core(1, output_bytes=64)  # the default open() matches results by request
    outs = step(core, si("r", chunk=0, last=False, seed=3), si("r", chunk=1, seed=3))
    assert shape(outs) == [("r", 0, False), ("r", 1, True)]
    for c, out in enumerate(outs):
        data = array_from_tensor(out.next[0].payload.tensors["data"])
        assert data.tobytes() == chunk_bytes(3, "synthetic/1", c, 64).tobytes()


# ---- streams that end early ------------------------------------------------------------------


def test_an_exception_mid_stream_fails_only_that_request() -> None:
    core, engine = chunky_core()
    step(core, si("bad", chunks=3, raise_at=1), si("good", chunks=3))
    bad, good = step(core)
    assert bad.error is not None and bad.error.code == "engine_error"
    assert "boom at 1" in bad.error.message and (bad.chunk, bad.last) == (1, True)
    assert bad.next == [] and bad.final is None
    assert (good.error, good.chunk) == (None, 1) and core.running == 1
    assert "bad" in engine.closed
    assert shape(step(core)) == [("good", 2, True)]


def test_a_stream_that_stops_without_a_last_result_is_an_engine_error() -> None:
    core, _ = chunky_core()
    (first,) = step(core, si("s", chunks=3, stop_at=1))
    assert first.error is None
    (out,) = step(core)
    assert out.error is not None and out.error.code == "engine_error"
    assert "without a last result" in out.error.message and out.chunk == 1
    assert core.running == 0


def test_an_empty_stream_is_no_result() -> None:
    core, _ = chunky_core()
    (out,) = step(core, si("e", chunks=3, stop_at=0))
    assert out.error is not None and "no result" in out.error.message


def test_abort_closes_a_running_stream() -> None:
    core, engine = chunky_core()
    step(core, si("a", chunks=5), si("b", chunks=5))
    aborted = core.abort("a")
    assert aborted is not None and aborted.request_id == "a"
    assert engine.closed == ["a"] and core.running == 1
    assert shape(step(core)) == [("b", 1, False)]
    assert core.abort("a") is None and core.abort("never-seen") is None


def test_a_stream_past_its_deadline_is_closed_with_a_deadline_error() -> None:
    core, engine = chunky_core()
    soon = int((time.time() + 0.15) * 1000)
    step(core, si("late", chunks=5, deadline_ms=soon), si("fine", chunks=5))
    time.sleep(0.2)
    late, fine = step(core)
    assert late.error is not None and late.error.code == "deadline"
    assert (late.request_id, late.chunk, late.last) == ("late", 1, True)
    assert (fine.error, fine.chunk) == (None, 1)
    assert engine.closed == ["late"] and core.running == 1
