"""EngineCore in-process: order, identity of next-stage inputs, fan-out, errors as data.

Tensors are materialised with plain in-memory callables (``array_from_tensor`` to read, a
counting wrapper around ``tensor_from_array`` to write): the same logic that the engine process
runs over shared memory, with no IO.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec, StageSpec
from omni_mesh.configs.registry import get_pipeline, register_pipeline
from omni_mesh.data_plane.messages import (
    Payload,
    SamplingParams,
    StageInput,
    StageOutput,
    Tensor,
)
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import (
    EngineContext,
    EngineInputError,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)
from omni_mesh.engines.core import EngineCore
from omni_mesh.engines.reference.code2wav import SAMPLE_RATE, SAMPLES_PER_FRAME
from omni_mesh.engines.reference.talker import NUM_CODEBOOKS
from omni_mesh.engines.synthetic import synthetic_bytes
from tests.engines.helpers import core_step

pytestmark = pytest.mark.unit

SYN = "omni_mesh.engines.synthetic:SyntheticEngine"
FAR_FUTURE_MS = int((time.time() + 3600) * 1000)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# ---- processors of the test pipelines (resolved by EngineCore through this module's name) -----


# plus_one's array, held here until plus_three runs: plus_three drops it just before making
# its own array, so the allocator can hand the freed slot (and so the id) straight back. Any
# fresh array may land on a dead one's id; this makes the timing deterministic.
_HELD: list[np.ndarray] = []


def plus_one(data: StageData) -> StageData:
    arr = data.arrays["data"].astype(np.int64) + 1
    _HELD.append(arr)
    return StageData(arrays={"x": arr})


def plus_two(data: StageData) -> StageData:
    return StageData(arrays={"x": data.arrays["data"].astype(np.int64) + 2})


def plus_three(data: StageData) -> StageData:
    base = data.arrays["data"].astype(np.int64)
    _HELD.clear()
    arr = np.empty(base.shape, dtype=np.int64)
    arr[...] = base + 3
    return StageData(arrays={"x": arr})


def needs_missing_field(data: StageData) -> StageData:
    return StageData(fields={"n": data.fields["no_such_field"]})


def buggy_processor(data: StageData) -> StageData:
    return StageData(arrays={"x": data.arrays["data"][0][0]})  # IndexError on a 1-D array


def _proc(fn: Callable[[StageData], StageData]) -> str:
    return f"{__name__}:{fn.__name__}"


# ---- test pipelines --------------------------------------------------------------------------

# Stage 0 is final itself (data) and feeds stages 1 and 2 unchanged: one array, three uses.
FANOUT = register_pipeline(
    PipelineSpec(
        name="test-core-fanout",
        stages=(
            StageSpec(stage_id=0, name="root", engine=SYN, final_output=OutputKind.DATA),
            StageSpec(stage_id=1, name="left", engine=SYN, sources=(0,), final_output="data"),
            StageSpec(stage_id=2, name="right", engine=SYN, sources=(0,), final_output="data"),
        ),
    ),
    replace=True,
)

# Stage 0 feeds three stages, each through a processor that builds a fresh array.
FANOUT_PROCESSED = register_pipeline(
    PipelineSpec(
        name="test-core-fanout-processed",
        stages=(
            StageSpec(stage_id=0, name="root", engine=SYN),
            StageSpec(stage_id=1, name="p1", engine=SYN, sources=(0,), processor=_proc(plus_one)),
            StageSpec(stage_id=2, name="p2", engine=SYN, sources=(0,), processor=_proc(plus_two)),
            StageSpec(
                stage_id=3,
                name="p3",
                engine=SYN,
                sources=(0,),
                processor=_proc(plus_three),
                final_output="data",
            ),
        ),
    ),
    replace=True,
)


def chain_with_processor(name: str, processor: Callable[[StageData], StageData]) -> PipelineSpec:
    return register_pipeline(
        PipelineSpec(
            name=name,
            stages=(
                StageSpec(stage_id=0, name="up", engine=SYN),
                StageSpec(
                    stage_id=1,
                    name="down",
                    engine=SYN,
                    sources=(0,),
                    processor=_proc(processor),
                    final_output="data",
                ),
            ),
        ),
        replace=True,
    )


# ---- helpers ---------------------------------------------------------------------------------


@dataclass
class CountingWriter:
    """``tensor_from_array`` on a private copy (like the shared-memory writer, it keeps no
    reference to the engine's array), recording every call."""

    calls: list[tuple[int, str]] = field(default_factory=list)  # (nbytes, owner)

    def __call__(self, arr: np.ndarray, owner: str) -> Tensor:
        self.calls.append((int(arr.nbytes), owner))
        return tensor_from_array(np.array(arr, copy=True))


def read(t: Tensor) -> np.ndarray:
    return array_from_tensor(t)


def stage_input(
    pipeline: str,
    stage_id: int,
    request_id: str = "req-1",
    *,
    seed: int = 7,
    fields: dict[str, str | int] | None = None,
    tensors: dict[str, Tensor] | None = None,
    sampling: SamplingParams | None = None,
    attempt: int = 0,
) -> StageInput:
    return StageInput(
        pipeline=pipeline,
        request_id=request_id,
        stage_id=stage_id,
        from_stage=stage_id - 1,
        attempt=attempt,
        deadline_ms=FAR_FUTURE_MS,
        seed=seed,
        traceparent=TRACEPARENT,
        sampling=sampling,
        payload=Payload(fields=dict(fields or {}), tensors=dict(tensors or {})),
    )


def synthetic_core(pipeline: PipelineSpec, stage_id: int, **config: float) -> EngineCore:
    ctx = EngineContext(
        pipeline, pipeline.stage(stage_id), StageDeployConfig(stage_id=stage_id, **config)
    )
    core = EngineCore.build(ctx)
    core.engine.load()
    return core


def step(
    core: EngineCore, inputs: Sequence[StageInput], writer: CountingWriter | None = None
) -> list[StageOutput]:
    now = time.monotonic()
    return core_step(core, [(si, now) for si in inputs], read, writer or CountingWriter())


class ScriptedEngine(StageEngine):
    """A test engine: echoes each request's fields and arrays; ``misbehave`` decides, per
    request id, to fail it as data (``"error"``), to leave it out (``"drop"``) or to raise
    :class:`EngineInputError` for the whole batch (``"raise"``). Results come back reversed."""

    def __init__(self, ctx: EngineContext, misbehave: dict[str, str] | None = None) -> None:
        super().__init__(ctx)
        self.misbehave = misbehave or {}
        self.batches: list[list[EngineRequest]] = []

    def load(self) -> None:
        pass

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        self.batches.append(list(batch))
        results = []
        for req in batch:
            action = self.misbehave.get(req.request_id)
            if action == "raise":
                raise EngineInputError(f"cannot batch request {req.request_id}")
            if action == "drop":
                continue
            if action == "error":
                results.append(EngineResult(req.request_id, error="prompt is too spicy"))
                continue
            out = StageData(fields=dict(req.data.fields), arrays=dict(req.data.arrays))
            results.append(EngineResult(req.request_id, output=out))
        return results[::-1]


def scripted_core(misbehave: dict[str, str] | None = None) -> EngineCore:
    pipeline = get_pipeline("synthetic")
    stage = pipeline.stage(1)
    ctx = EngineContext(pipeline, stage, StageDeployConfig(stage_id=1))
    return EngineCore(pipeline, stage, ScriptedEngine(ctx, misbehave))


# ---- order and identity ----------------------------------------------------------------------


def test_outputs_come_back_in_input_order_whatever_the_engine_order() -> None:
    core = scripted_core({"b": "error"})
    bad = Tensor(dtype="float32", shape=(3,), data=memoryview(b"\0" * 5))
    inputs = [
        stage_input("synthetic", 1, rid, fields={"i": i})
        for i, rid in enumerate(["a", "b", "c", "d"])
    ]
    inputs.insert(2, stage_input("synthetic", 1, "bad", tensors={"h": bad}))
    outputs = step(core, inputs)
    assert [o.request_id for o in outputs] == ["a", "b", "bad", "c", "d"]
    assert all(o.stage_id == 1 for o in outputs)
    assert [o.error is None for o in outputs] == [True, False, False, True, True]
    assert [o.next[0].payload.fields["i"] for o in outputs if o.error is None] == [0, 2, 3]
    assert step(core, []) == []


def test_next_stage_input_keeps_the_request_identity() -> None:
    core = synthetic_core(get_pipeline("synthetic"), 0, output_bytes=10_000)
    sampling = SamplingParams(temperature=0.3, top_k=5, max_tokens=12)
    si = stage_input(
        "synthetic", 0, "keep-me", seed=4242, fields={"prompt": "hi"}, sampling=sampling, attempt=3
    )
    (out,) = step(core, [si])
    assert out.error is None and out.final is None  # stage 0 is not final
    (nxt,) = out.next
    assert (nxt.pipeline, nxt.request_id, nxt.seed) == ("synthetic", "keep-me", 4242)
    assert (nxt.deadline_ms, nxt.traceparent, nxt.sampling) == (
        FAR_FUTURE_MS,
        TRACEPARENT,
        sampling,
    )
    assert (nxt.stage_id, nxt.from_stage) == (1, 0)
    assert (nxt.chunk, nxt.attempt) == (0, 0)  # a new transfer: its own attempts start at 0
    assert nxt.payload.fields == {"prompt": "hi"}
    data = read(nxt.payload.tensors["data"])
    assert data.tobytes() == synthetic_bytes(4242, "synthetic/0", 10_000).tobytes()


def test_final_stage_gives_final_output_and_no_next() -> None:
    core = synthetic_core(get_pipeline("synthetic"), 2, output_bytes=300)
    (out,) = step(core, [stage_input("synthetic", 2, seed=9)])
    assert out.error is None and out.next == []
    assert out.final is not None
    assert (
        read(out.final.tensors["data"]).tobytes()
        == synthetic_bytes(9, "synthetic/2", 300).tobytes()
    )


def test_engine_sees_fields_arrays_seed_and_sampling() -> None:
    core = scripted_core()
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    sampling = SamplingParams(temperature=0.0)
    si = stage_input(
        "synthetic",
        1,
        "r",
        seed=11,
        fields={"voice": "echo"},
        tensors={"hidden": tensor_from_array(hidden)},
        sampling=sampling,
    )
    step(core, [si])
    engine = core.engine
    assert isinstance(engine, ScriptedEngine)
    ((req,),) = engine.batches
    assert (req.request_id, req.seed, req.sampling) == ("r", 11, sampling)
    assert req.data.fields == {"voice": "echo"}
    np.testing.assert_array_equal(req.data.arrays["hidden"], hidden)


def test_timings_count_queue_and_engine_time() -> None:
    core = synthetic_core(get_pipeline("synthetic"), 1, step_latency_ms=30)
    enqueued = time.monotonic() - 0.2
    (out,) = core_step(core, [(stage_input("synthetic", 1), enqueued)], read, CountingWriter())
    assert out.queue_ms >= 200.0
    assert out.engine_ms >= 29.0


# ---- fan-out and write-once ------------------------------------------------------------------


def test_fan_out_builds_one_input_per_downstream_stage() -> None:
    core = synthetic_core(FANOUT, 0, output_bytes=8192)
    (out,) = step(core, [stage_input(FANOUT.name, 0, "fan", seed=3, fields={"prompt": "p"})])
    assert out.error is None
    assert [(n.stage_id, n.from_stage) for n in out.next] == [(1, 0), (2, 0)]
    assert {n.request_id for n in out.next} == {"fan"}
    assert all(n.payload.fields == {"prompt": "p"} for n in out.next)
    expected = synthetic_bytes(3, f"{FANOUT.name}/0", 8192).tobytes()
    assert out.final is not None
    assert read(out.final.tensors["data"]).tobytes() == expected
    assert all(read(n.payload.tensors["data"]).tobytes() == expected for n in out.next)


def test_an_array_shared_by_final_and_next_is_written_once() -> None:
    core = synthetic_core(FANOUT, 0, output_bytes=8192)
    writer = CountingWriter()
    outs = step(
        core, [stage_input(FANOUT.name, 0, "w1"), stage_input(FANOUT.name, 0, "w2")], writer
    )
    assert sorted(writer.calls) == [(8192, "w1"), (8192, "w2")]  # one write per request
    for out in outs:
        assert out.final is not None
        final = out.final.tensors["data"]
        assert all(n.payload.tensors["data"] is final for n in out.next)


def test_fan_out_through_processors_gives_each_stage_its_own_array() -> None:
    core = synthetic_core(FANOUT_PROCESSED, 0, output_bytes=64)
    for i in range(20):
        (out,) = step(core, [stage_input(FANOUT_PROCESSED.name, 0, f"r{i}", seed=i)])
        base = synthetic_bytes(i, f"{FANOUT_PROCESSED.name}/0", 64).astype(np.int64)
        got = {n.stage_id: read(n.payload.tensors["x"]) for n in out.next}
        for stage_id in (1, 2, 3):
            np.testing.assert_array_equal(got[stage_id], base + stage_id, f"stage {stage_id}")


# ---- failures travel as data -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (Tensor(dtype="float32", shape=(4,), data=memoryview(b"\0" * 3)), "needs 16 bytes"),
        (Tensor(dtype="complex64", shape=(1,), data=memoryview(b"\0" * 8)), "not allowed"),
        (Tensor(dtype="uint8", shape=(2,)), "exactly one of"),
    ],
)
def test_bad_input_tensor_fails_alone_as_bad_input(tensor: Tensor, words: str) -> None:
    core = synthetic_core(get_pipeline("synthetic"), 1)
    good = stage_input("synthetic", 1, "good")
    bad = stage_input("synthetic", 1, "bad", tensors={"hidden": tensor})
    out_good, out_bad, out_good2 = step(core, [good, bad, stage_input("synthetic", 1, "good2")])
    assert out_good.error is None and out_good2.error is None
    assert out_bad.error is not None
    assert (out_bad.error.code, out_bad.error.stage_id) == ("bad_input", 1)
    assert words in out_bad.error.message
    assert out_bad.next == [] and out_bad.final is None


def test_bad_input_message_names_the_tensor() -> None:
    core = synthetic_core(get_pipeline("synthetic"), 1)
    bad = Tensor(dtype="float32", shape=(4,), data=memoryview(b"\0" * 3))
    (out,) = step(core, [stage_input("synthetic", 1, tensors={"hidden_states": bad})])
    assert out.error is not None and out.error.code == "bad_input"
    assert "hidden_states" in out.error.message


def test_engine_error_result_fails_only_that_request() -> None:
    core = scripted_core({"b": "error"})
    a, b, c = step(core, [stage_input("synthetic", 1, rid) for rid in "abc"])
    assert a.error is None and c.error is None
    assert b.error is not None
    assert (b.error.code, b.error.stage_id, b.error.message) == (
        "bad_input",
        1,
        "prompt is too spicy",
    )
    assert b.next == []


def test_engine_input_error_fails_the_batch_as_bad_input() -> None:
    core = scripted_core({"b": "raise"})
    outs = step(core, [stage_input("synthetic", 1, rid) for rid in "abc"])
    assert [o.request_id for o in outs] == ["a", "b", "c"]
    for o in outs:
        assert o.error is not None and o.error.code == "bad_input"
        assert "cannot batch request b" in o.error.message


def test_missing_engine_result_is_an_engine_error() -> None:
    core = scripted_core({"b": "drop"})
    a, b, c = step(core, [stage_input("synthetic", 1, rid) for rid in "abc"])
    assert a.error is None and c.error is None
    assert b.error is not None
    assert (b.error.code, b.error.stage_id) == ("engine_error", 1)
    assert "no result" in b.error.message


def test_processor_error_is_an_engine_error_naming_the_stage() -> None:
    pipeline = chain_with_processor("test-core-keyerror", needs_missing_field)
    core = synthetic_core(pipeline, 0)
    (out,) = step(core, [stage_input(pipeline.name, 0)])
    assert out.error is not None
    assert (out.error.code, out.error.stage_id) == ("engine_error", 0)
    assert "processor for stage 1" in out.error.message
    assert "no_such_field" in out.error.message
    assert out.next == [] and out.final is None


def test_any_processor_exception_fails_only_its_request() -> None:
    pipeline = chain_with_processor("test-core-buggy", buggy_processor)
    core = synthetic_core(pipeline, 0)
    outs = step(core, [stage_input(pipeline.name, 0, "a"), stage_input(pipeline.name, 0, "b")])
    for out in outs:
        assert out.error is not None and out.error.code == "engine_error"
        assert "processor for stage 1" in out.error.message


# ---- the reference tiny-tts path -------------------------------------------------------------


@pytest.fixture(scope="module")
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def reference_core(pipeline: PipelineSpec, stage_id: int) -> EngineCore:
    ctx = EngineContext(pipeline, pipeline.stage(stage_id), StageDeployConfig(stage_id=stage_id))
    core = EngineCore.build(ctx)
    core.engine.load()
    return core


class MissingCodesTalker(StageEngine):
    """A talker stand-in whose output lacks ``codes``: the real processor must refuse it."""

    def load(self) -> None:
        pass

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        return [
            EngineResult(r.request_id, output=StageData(fields={"num_frames": 1})) for r in batch
        ]


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_one_thread")
def test_tiny_tts_talker_to_code2wav_through_engine_core() -> None:
    tts = get_pipeline("tiny-tts")
    talker, code2wav = reference_core(tts, 0), reference_core(tts, 1)
    prompt = stage_input(
        "tiny-tts", 0, "tts-1", seed=5, fields={"prompt": "hello there", "max_tokens": 6}
    )
    (out0,) = step(talker, [prompt])
    assert out0.error is None and out0.final is None
    (hop,) = out0.next
    assert (hop.stage_id, hop.from_stage, hop.request_id, hop.seed) == (1, 0, "tts-1", 5)
    assert set(hop.payload.tensors) == {"codes"}  # the processor keeps only what code2wav reads
    codes = read(hop.payload.tensors["codes"])
    assert codes.dtype == np.int64 and codes.shape == (6, NUM_CODEBOOKS)

    (out1,) = step(code2wav, [hop])
    assert out1.error is None and out1.next == []
    assert out1.final is not None
    assert out1.final.fields["sample_rate"] == SAMPLE_RATE
    wave = read(out1.final.tensors["waveform"])
    assert wave.dtype == np.float32 and wave.shape == (6 * SAMPLES_PER_FRAME,)
    assert np.isfinite(wave).all() and np.abs(wave).max() < 1.0

    (again,) = step(talker, [prompt])  # deterministic for the seed: a replay gives same bytes
    np.testing.assert_array_equal(read(again.next[0].payload.tensors["codes"]), codes)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_one_thread")
def test_tiny_tts_processor_refuses_an_output_without_codes() -> None:
    tts = get_pipeline("tiny-tts")
    ctx = EngineContext(tts, tts.stage(0), StageDeployConfig(stage_id=0))
    core = EngineCore(tts, tts.stage(0), MissingCodesTalker(ctx))
    (out,) = step(core, [stage_input("tiny-tts", 0, fields={"prompt": "x"})])
    assert out.error is not None
    assert (out.error.code, out.error.stage_id) == ("engine_error", 0)
    assert "processor for stage 1" in out.error.message
    assert "talker_to_code2wav" in out.error.message and "'codes'" in out.error.message


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_one_thread")
def test_tiny_tts_bad_voice_fails_alone() -> None:
    tts = get_pipeline("tiny-tts")
    talker = reference_core(tts, 0)
    good = stage_input("tiny-tts", 0, "good", fields={"prompt": "hi", "max_tokens": 2})
    bad = stage_input("tiny-tts", 0, "bad", fields={"prompt": "hi", "voice": "kazoo"})
    out_good, out_bad = step(talker, [good, bad])
    assert out_good.error is None and len(out_good.next) == 1
    assert out_bad.error is not None and out_bad.error.code == "bad_input"
    assert "voice" in out_bad.error.message and "'bad'" in out_bad.error.message
