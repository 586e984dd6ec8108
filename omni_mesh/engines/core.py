"""EngineCore: the inner loop of a stage's engine process, with no IO.

It turns a batch of :class:`StageInput` into :class:`StageOutput`: resolve inputs, run the
engine, apply the downstream stages' processors, and build every next-stage input with the
same request identity (invariants 1 and 2). How tensors are materialised (shared memory in the
process wrapper, plain bytes in tests) is injected as two callables.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from omni_mesh.configs.pipeline import PipelineSpec, StageSpec
from omni_mesh.data_plane.messages import (
    Payload,
    StageError,
    StageInput,
    StageOutput,
    Tensor,
)
from omni_mesh.engines.base import (
    EngineContext,
    EngineInputError,
    EngineRequest,
    EngineResult,
    OutputCapacityError,
    Processor,
    StageData,
    StageEngine,
    import_object,
)

logger = logging.getLogger(__name__)

#: Resolves a payload tensor into a numpy array (zero-copy view where possible).
ArrayReader = Callable[[Tensor], np.ndarray]
#: Turns an output array into a wire tensor, owned on behalf of ``request_id``.
ArrayWriter = Callable[[np.ndarray, str], Tensor]


class EngineCore:
    """Runs one stage's engine over batches; pure logic, testable in-process."""

    def __init__(self, pipeline: PipelineSpec, stage: StageSpec, engine: StageEngine) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.engine = engine
        self.downstream: tuple[StageSpec, ...] = tuple(
            pipeline.stage(j) for j in pipeline.downstream(stage.stage_id)
        )
        self._processors: dict[int, Processor | None] = {
            s.stage_id: (import_object(s.processor) if s.processor else None)
            for s in self.downstream
        }

    @classmethod
    def build(cls, ctx: EngineContext) -> EngineCore:
        engine_cls = import_object(ctx.stage.engine)
        if not (isinstance(engine_cls, type) and issubclass(engine_cls, StageEngine)):
            raise TypeError(f"{ctx.stage.engine!r} is not a StageEngine subclass")
        return cls(ctx.pipeline, ctx.stage, engine_cls(ctx))

    def step(
        self,
        batch: Sequence[tuple[StageInput, float]],
        read: ArrayReader,
        write: ArrayWriter,
    ) -> list[StageOutput]:
        """Execute one batch of (input, enqueue time); one output per input, same order."""
        # 1) Resolve every input; a bad one fails alone, as data.
        requests: list[EngineRequest] = []
        outputs: dict[str, StageOutput] = {}
        queued_at: dict[str, float] = {}
        inputs: dict[str, StageInput] = {}
        for si, t_enqueued in batch:
            inputs[si.request_id] = si
            queued_at[si.request_id] = t_enqueued
            try:
                requests.append(self._to_request(si, read))
            except (EngineInputError, ValueError) as exc:
                outputs[si.request_id] = self._error(si, "bad_input", str(exc))
        # 2) Run the engine on what is left.
        t0 = time.monotonic()
        results = self._execute(requests, outputs, inputs)
        engine_ms = (time.monotonic() - t0) * 1000.0
        # 3) Build outputs and next-stage inputs.
        for result in results:
            si = inputs[result.request_id]
            queue_ms = max(0.0, (t0 - queued_at[si.request_id]) * 1000.0)
            try:
                outputs[si.request_id] = self._to_output(si, result, write, engine_ms, queue_ms)
            except OutputCapacityError as exc:
                outputs[si.request_id] = self._error(si, "unavailable", str(exc))
        return [outputs[si.request_id] for si, _ in batch]

    # ---- helpers -------------------------------------------------------------------------

    def _execute(
        self,
        requests: list[EngineRequest],
        outputs: dict[str, StageOutput],
        inputs: dict[str, StageInput],
    ) -> list[EngineResult]:
        if not requests:
            return []
        try:
            results = self.engine.execute(requests)
        except EngineInputError as exc:
            # The engine could not say which request was bad: fail the batch as bad input.
            for req in requests:
                outputs[req.request_id] = self._error(inputs[req.request_id], "bad_input", str(exc))
            return []
        except Exception as exc:
            # A failed step fails its batch, as data; the engine keeps serving the next one.
            logger.exception(
                "engine step failed stage=%d batch=%d", self.stage.stage_id, len(requests)
            )
            message = f"{type(exc).__name__}: {exc}"
            for req in requests:
                outputs[req.request_id] = self._error(
                    inputs[req.request_id], "engine_error", message
                )
            return []
        by_id = {r.request_id: r for r in results}
        missing = [r.request_id for r in requests if r.request_id not in by_id]
        for rid in missing:
            outputs[rid] = self._error(inputs[rid], "engine_error", "engine returned no result")
        return [by_id[r.request_id] for r in requests if r.request_id in by_id]

    def _to_request(self, si: StageInput, read: ArrayReader) -> EngineRequest:
        arrays = {}
        for name, t in si.payload.tensors.items():
            try:
                arrays[name] = read(t)
            except ValueError as exc:
                raise EngineInputError(
                    f"stage {self.stage.stage_id} ({self.stage.name}): tensor {name!r}: {exc}"
                ) from None
        data = StageData(fields=dict(si.payload.fields), arrays=arrays)
        return EngineRequest(
            request_id=si.request_id, seed=si.seed, data=data, sampling=si.sampling
        )

    def _to_output(
        self,
        si: StageInput,
        result: EngineResult,
        write: ArrayWriter,
        engine_ms: float,
        queue_ms: float,
    ) -> StageOutput:
        if result.error is not None:
            return self._error(si, "bad_input", result.error)
        # One slot per array, however many consumers. The arrays are kept alive with their
        # tensors: a freed array's id() may be reused by the next processor's new array.
        written: dict[int, tuple[np.ndarray, Tensor]] = {}

        def payload(data: StageData) -> Payload:
            tensors: dict[str, Tensor] = {}
            for name, arr in data.arrays.items():
                key = id(arr)
                if key not in written:
                    written[key] = (arr, write(arr, si.request_id))
                tensors[name] = written[key][1]
            return Payload(fields=dict(data.fields), tensors=tensors)

        final = payload(result.final) if result.final is not None else None
        nexts = []
        for spec in self.downstream:
            processor = self._processors[spec.stage_id]
            try:
                data = processor(result.output) if processor is not None else result.output
            except Exception as exc:  # a processor bug fails its request, never the engine
                logger.exception(
                    "processor failed request_id=%s stage=%d", si.request_id, spec.stage_id
                )
                return self._error(
                    si,
                    "engine_error",
                    f"processor for stage {spec.stage_id}: {type(exc).__name__}: {exc}",
                )
            nexts.append(
                StageInput(
                    pipeline=si.pipeline,
                    request_id=si.request_id,
                    stage_id=spec.stage_id,
                    from_stage=self.stage.stage_id,
                    chunk=0,
                    attempt=0,
                    deadline_ms=si.deadline_ms,
                    seed=si.seed,
                    traceparent=si.traceparent,
                    sampling=si.sampling,
                    payload=payload(data),
                )
            )
        return StageOutput(
            request_id=si.request_id,
            stage_id=self.stage.stage_id,
            final=final,
            next=nexts,
            engine_ms=engine_ms,
            queue_ms=queue_ms,
        )

    def _error(self, si: StageInput, code: str, message: str) -> StageOutput:
        logger.info(
            "request failed request_id=%s stage=%d code=%s: %s",
            si.request_id,
            self.stage.stage_id,
            code,
            message,
        )
        return StageOutput(
            request_id=si.request_id,
            stage_id=self.stage.stage_id,
            error=StageError(code=code, message=message, stage_id=self.stage.stage_id),  # type: ignore[arg-type]
        )
