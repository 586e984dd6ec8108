"""The local engine's outputs for one stage input, inside the stage's trace span: what
:class:`~omni_mesh.sidecar.runner.StageRunner` runs on every hop (and ``/v1/run`` call).

Work left before its end (the caller went away: a client's disconnect, a realtime barge-in)
is acknowledged in the span: an ``omni.cancel`` event when the stage leaves it, and an
``omni.cancel.acknowledged`` event when the engine has stopped it (``omni.abort``:
``aborted`` with the milliseconds it took, ``idle`` when its part was done, ``engine_died``);
the span ends then, so every stage's part of a cancel is in the request's trace."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import msgspec

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane.messages import StageInput, StageOutput, transfer_key
from omni_mesh.observability.tracing import StageSpan, open_stage_span, tracing_on
from omni_mesh.sidecar.engine_link.client import EngineClient


class StageOfPod(Protocol):
    """What the outputs read of the stage that runs them (the pod's ``StageRunner``)."""

    stage_id: int
    pipeline: PipelineSpec
    engine: EngineClient
    on_chunk: Callable[[], None] | None

    def instance_id(self) -> str: ...

    def start_feeding(self, si: StageInput) -> asyncio.Task[None] | None: ...


class EngineOutputs:
    """The local engine's outputs for one input, inside this stage's span: ``async with`` it,
    then iterate it. The outputs' tensors stay valid inside the block (the engine's slots are
    released after it, only when an output used them), and next-stage inputs carry this span
    as their parent. A class rather than generators: it runs on every hop."""

    def __init__(self, runner: StageOfPod, si: StageInput) -> None:
        self._runner = runner
        self._si = si
        self._stream = runner.engine.stream(si)
        self._span: StageSpan | None = None
        self._traceparent = si.traceparent
        self._holds_slots = False
        self._feeding: asyncio.Task[None] | None = None  # a streamed input's pulls

    async def __aenter__(self) -> EngineOutputs:
        self._feeding = self._runner.start_feeding(self._si)
        if not tracing_on():  # no span: next stages keep the parent's traceparent
            return self
        runner, si = self._runner, self._si
        name = f"stage {runner.stage_id} {runner.pipeline.stage(runner.stage_id).name}"
        attributes: dict[str, str | int] = {
            "omni.request_id": si.request_id,
            "omni.pipeline": runner.pipeline.name,
            "omni.stage_id": runner.stage_id,
            "omni.attempt": si.attempt,
            "omni.instance_id": runner.instance_id(),
        }
        self._span = open_stage_span(name, si.traceparent, attributes)
        if self._span is not None:
            self._traceparent = self._span.traceparent
        return self

    def __aiter__(self) -> EngineOutputs:
        return self

    async def __anext__(self) -> StageOutput:
        out = await self._stream.__anext__()
        self._holds_slots = self._holds_slots or out.error is not None or _holds_slots(out)
        on_chunk = self._runner.on_chunk
        if on_chunk is not None and not (out.last and out.chunk == 0):
            on_chunk()
        if self._traceparent != self._si.traceparent:
            traceparent = self._traceparent
            out.next = [msgspec.structs.replace(n, traceparent=traceparent) for n in out.next]
        return out

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._feeding is not None:
                self._feeding.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # (it logs its own)
                    await self._feeding
            await self._stream.aclose()  # left early: the engine aborts the work
            if self._holds_slots:
                self._runner.engine.release(transfer_key(self._si))  # one IPC message
        finally:
            if self._span is not None:
                self._end_span(exc)

    def _end_span(self, exc: BaseException | None) -> None:
        """End the span now, or — the work was left while the engine ran it — once the engine
        has acknowledged the abort."""
        span = self._span
        assert span is not None
        runner = self._runner
        t0 = time.perf_counter()

        def acknowledged(how: str) -> None:
            ms = round((time.perf_counter() - t0) * 1000.0, 3)
            span.acknowledged(
                {"omni.stage_id": runner.stage_id, "omni.abort": how, "omni.abort_ms": ms}
            )

        # _stream.aclose() has run: an abort is outstanding iff the engine was still on it.
        # A cancelled task with none outstanding had its engine part done (it was passing on
        # the next stages' answers); a GeneratorExit with none is a whole answer's end.
        attributes: dict[str, str | int] = {
            "omni.stage_id": runner.stage_id,
            "omni.instance_id": runner.instance_id(),
        }
        if runner.engine.when_aborted(transfer_key(self._si), acknowledged):
            span.cancelled(attributes)
        elif isinstance(exc, asyncio.CancelledError):
            span.cancelled(attributes)
            acknowledged("idle")
        else:
            span.end(exc)


def _holds_slots(out: StageOutput) -> bool:
    """Whether the engine wrote any of this output into its shared memory."""
    payloads = [n.payload for n in out.next]
    if out.final is not None:
        payloads.append(out.final)
    return any(t.shm is not None for p in payloads for t in p.tensors.values())
