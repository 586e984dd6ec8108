"""Running a request from this stage onward.

``run_chain`` is the orchestrated path: execute the local stage, hand each next-stage input to
a replica of that stage (fan-out in parallel), and merge the final outputs that come back.
``executed`` is the ``/v1/run`` path: execute the local stage only and let the caller turn the
next-stage inputs into opaque envelopes. Both run the same engine call (invariant 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from omni_mesh.configs.pipeline import PipelineSpec
from omni_mesh.data_plane.messages import (
    HopResult,
    Payload,
    StageError,
    StageInput,
    StageOutput,
    StageTiming,
    Tensor,
)
from omni_mesh.data_plane.shm import ShmReader, inline
from omni_mesh.data_plane.tensors import payload_nbytes
from omni_mesh.observability.tracing import stage_span
from omni_mesh.sidecar.engine_client import EngineClient
from omni_mesh.sidecar.handoff import HopClient

logger = logging.getLogger(__name__)


def owned(payload: Payload, reader: ShmReader) -> Payload:
    """A copy of ``payload`` whose tensors are inline bytes we own (not shm slots that the
    engine will reuse)."""
    view = inline(payload, reader)
    tensors = {
        name: Tensor(dtype=t.dtype, shape=t.shape, data=memoryview(bytes(t.data or b"")))
        for name, t in view.tensors.items()
    }
    return Payload(fields=dict(payload.fields), tensors=tensors)


class StageRunner:
    def __init__(
        self,
        pipeline: PipelineSpec,
        stage_id: int,
        engine: EngineClient,
        hop: HopClient,
        instance_id: Callable[[], str],
    ) -> None:
        self.pipeline = pipeline
        self.stage_id = stage_id
        self.engine = engine
        self.hop = hop
        self.instance_id = instance_id

    @contextlib.asynccontextmanager
    async def executed(self, si: StageInput) -> AsyncIterator[StageOutput]:
        """Run the local engine inside this stage's span; the output's tensors stay valid
        inside the block, and the next-stage inputs carry this span as their parent."""
        name = f"stage {self.stage_id} {self.pipeline.stage(self.stage_id).name}"
        attributes: dict[str, str | int] = {
            "omni.request_id": si.request_id,
            "omni.pipeline": self.pipeline.name,
            "omni.stage_id": self.stage_id,
            "omni.attempt": si.attempt,
            "omni.instance_id": self.instance_id(),
        }
        with stage_span(name, si.traceparent, attributes) as traceparent:
            out = await self.engine.execute(si)
            if traceparent != si.traceparent:
                out.next = [msgspec.structs.replace(n, traceparent=traceparent) for n in out.next]
            try:
                yield out
            finally:
                if out.error is not None or _holds_slots(out):
                    self.engine.release(si.request_id)  # one IPC message, only when needed

    async def run_chain(self, si: StageInput) -> HopResult:
        t0 = time.monotonic()
        async with self.executed(si) as out:
            if out.error is not None:
                return HopResult(request_id=si.request_id, error=out.error)
            outputs: dict[int, Payload] = {}
            if out.final is not None:
                outputs[self.stage_id] = owned(out.final, self.engine.reader)
            timing = StageTiming(
                stage_id=self.stage_id,
                instance_id=self.instance_id(),
                engine_ms=out.engine_ms,
                queue_ms=out.queue_ms,
                total_ms=0.0,
                output_bytes=sum(payload_nbytes(n.payload) for n in out.next),
            )
            results = await asyncio.gather(*(self.hop.send(n) for n in out.next))
        timing = msgspec.structs.replace(timing, total_ms=(time.monotonic() - t0) * 1000.0)
        return merge(si.request_id, outputs, timing, results)


def _holds_slots(out: StageOutput) -> bool:
    """Whether the engine wrote any of this output into its shared memory."""
    payloads = [n.payload for n in out.next]
    if out.final is not None:
        payloads.append(out.final)
    return any(t.shm is not None for p in payloads for t in p.tensors.values())


def merge(
    request_id: str,
    outputs: dict[int, Payload],
    timing: StageTiming,
    downstream: list[HopResult],
) -> HopResult:
    """Merge this stage's outputs with what came back from every branch; first error wins."""
    timings = [timing]
    error: StageError | None = None
    for r in downstream:
        outputs.update(r.outputs)
        timings.extend(r.timings)
        if r.error is not None and error is None:
            error = r.error
    return HopResult(request_id=request_id, outputs=outputs, timings=timings, error=error)
