"""The local engine's outputs for one stage input, inside the stage's trace span: what
:class:`~omni_mesh.sidecar.runner.StageRunner` runs on every hop (and ``/v1/run`` call)."""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import TYPE_CHECKING

import msgspec

from omni_mesh.data_plane.messages import StageInput, StageOutput, transfer_key
from omni_mesh.observability.tracing import stage_span, tracing_on

if TYPE_CHECKING:
    from omni_mesh.sidecar.runner import StageRunner


class EngineOutputs:
    """The local engine's outputs for one input, inside this stage's span: ``async with`` it,
    then iterate it. The outputs' tensors stay valid inside the block (the engine's slots are
    released after it, only when an output used them), and next-stage inputs carry this span
    as their parent. A class rather than generators: it runs on every hop."""

    def __init__(self, runner: StageRunner, si: StageInput) -> None:
        self._runner = runner
        self._si = si
        self._stream = runner.engine.stream(si)
        self._span: contextlib.AbstractContextManager[str] | None = None
        self._traceparent = si.traceparent
        self._holds_slots = False

    async def __aenter__(self) -> EngineOutputs:
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
        self._span = stage_span(name, si.traceparent, attributes)
        self._traceparent = self._span.__enter__()
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
            await self._stream.aclose()  # left early: the engine aborts the work
            if self._holds_slots:
                self._runner.engine.release(transfer_key(self._si))  # one IPC message
        finally:
            if self._span is not None:
                self._span.__exit__(exc_type, exc, tb)


def _holds_slots(out: StageOutput) -> bool:
    """Whether the engine wrote any of this output into its shared memory."""
    payloads = [n.payload for n in out.next]
    if out.final is not None:
        payloads.append(out.final)
    return any(t.shm is not None for p in payloads for t in p.tensors.values())
