"""Running a request from this stage onward.

``run_stream`` is the orchestrated path: execute the local stage, hand each next-stage input to
a replica of that stage (fan-out and chunks in parallel), and pass the final outputs that come
back upstream as :class:`HopResult` frames. ``executed`` is the ``/v1/run`` path: execute the
local stage only and let the caller turn the next-stage inputs into opaque envelopes. Both run
the same engine call (invariant 1).

A whole output with at most one next stage — every hop unless ``async_chunk`` is on — takes a
straight path: one downstream call, and its answer merged with this stage's into one frame.
Chunks and fan-out go through a :class:`FrameMerger`: one task per engine stream and per
downstream hop, their frames passed on as they arrive.

Joins (a stage with several sources, see ``data_plane/joins.py``): a source of a join does not
hop to it; its input for the join goes back up in its answer (``HopResult.joins``), relayed by
every runner on the way, to the runner executing the join's collector stage for the request
(which spawned the branches). That runner holds one input per source until it has them all,
then hands the join off once, like any hop (custody, replay, deadline). Pipelines without joins
pay one set lookup per hop for this.

Streamed inputs (a next stage whose spec has ``stream_input``, ``sidecar/hop/input_stream.py``):
the first chunk for it hops as any input does, naming this sidecar in ``stream_from``; the
later chunks stay here (:class:`InputFeeds`) until the request's run ends, and the replica
that runs it pulls them. On the receiving side, :class:`InputFeeds` pulls the chunks of a
streamed input this stage runs and feeds them to the engine. ``/v1/run`` hands such a stage
its input in one piece (:func:`~omni_mesh.data_plane.chunk_merge.merged_input`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane.chunk_merge import merged_input
from omni_mesh.data_plane.joins import JoinInputError, join_input
from omni_mesh.data_plane.messages import (
    HopResult,
    Payload,
    StageError,
    StageInput,
    StageOutput,
    StageTiming,
    Tensor,
    is_whole,
    opens_input_stream,
    streams_out,
    transfer_key,
)
from omni_mesh.data_plane.shm import ShmReader, inline
from omni_mesh.data_plane.tensors import payload_nbytes
from omni_mesh.sidecar.engine_link.client import EngineClient, EngineDeadError
from omni_mesh.sidecar.engine_link.outputs import EngineOutputs
from omni_mesh.sidecar.hop.budget import HopUnavailable
from omni_mesh.sidecar.hop.client import HopClient
from omni_mesh.sidecar.hop.input_stream import InputPullError, InputStreams, OutStream, pull_input

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
        on_chunk: Callable[[], None] | None = None,
        inputs: InputFeeds | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.inputs = inputs  # streamed inputs: held for the next stage, fed to this engine
        self.stage_id = stage_id
        self.engine = engine
        self.hop = hop
        self.instance_id = instance_id
        self.on_chunk = on_chunk  # called for every output chunk (not for whole outputs)
        # Next stages that are joins: their inputs go back up, not to a replica of them.
        self._to_joins = frozenset(j for j in pipeline.downstream(stage_id) if pipeline.is_join(j))
        # Joins whose inputs this stage's runner collects (it is their collector).
        self._collects = frozenset(
            j for j, c in pipeline.join_collectors().items() if c == stage_id
        )
        # Next stages that take their input as a stream (spec ``stream_input``).
        self._streamed = frozenset(
            j for j in pipeline.downstream(stage_id) if pipeline.stage(j).stream_input
        )

    def _engine_outputs(self, si: StageInput) -> EngineOutputs:
        """The local engine's outputs for ``si`` (``async with``, then iterate)."""
        return EngineOutputs(self, si)

    @contextlib.asynccontextmanager
    async def executed(self, si: StageInput) -> AsyncIterator[list[StageOutput]]:
        """Run the local stage only: every output chunk, in order (a whole output is a list
        of one; a failed chunk ends the list). Tensors stay valid inside the block."""
        async with self._engine_outputs(si) as stream:
            outputs = [out async for out in stream]
            yield self._whole_inputs(outputs) if self._streamed else outputs

    def start_feeding(self, si: StageInput) -> asyncio.Task[None] | None:
        """For the first chunk of a streamed input this stage runs: a task that pulls the
        later chunks and feeds them to the engine (None for any other input)."""
        if not opens_input_stream(si) or self.inputs is None:
            return None
        return asyncio.get_running_loop().create_task(
            self.inputs.feed_engine(self.engine, self.hop, si)
        )

    def _whole_inputs(self, outputs: list[StageOutput]) -> list[StageOutput]:
        """``outputs`` with the chunks for each streamed-input next stage merged into one
        whole input, on the last output (``/v1/run`` hands on whole inputs only)."""
        chunks: dict[int, list[StageInput]] = {}
        for out in outputs:
            keep = []
            for n in out.next:
                if n.stage_id in self._streamed and not is_whole(n):
                    chunks.setdefault(n.stage_id, []).append(n)
                else:
                    keep.append(n)
            out.next = keep
        if chunks and outputs and outputs[-1].error is None:
            last = outputs[-1]
            try:
                joined = [merged_input(c, self.engine.reader) for c in chunks.values()]
            except ValueError as exc:  # the engine's chunks do not join: its bug, this request's
                error = StageError(code="engine_error", message=str(exc), stage_id=self.stage_id)
                last.error, last.next, last.final = error, [], None
                return outputs
            last.next = [*last.next, *joined]
        return outputs

    async def prefill(self, si: StageInput) -> AsyncGenerator[HopResult, None]:
        """A split stage's prefill request (``data_plane/kv_transfer.py``): run the local
        engine only and answer, in one frame, where the prompt's KV waits (nothing goes on
        to the next stages: the decode replica's run does that)."""
        async with self.executed(si) as outputs:
            out = outputs[-1]
        yield HopResult(request_id=si.request_id, error=out.error, kv_transfer=out.kv_transfer)

    async def run_stream(self, si: StageInput) -> AsyncGenerator[HopResult, None]:
        """The orchestrated path from this stage on, as frames (the last has ``more=False``;
        an error frame is the last). Close it (``aclosing``) to abandon the request."""
        t0 = time.monotonic()
        timing = StageTiming(self.stage_id, self.instance_id(), 0.0, 0.0, 0.0)
        async with self._engine_outputs(si) as outputs:
            first = await anext(outputs)
            if (first.last or not streams_out(si)) and len(first.next) <= 1:  # one output
                # The straight path (a whole output, at most one next stage), inline: one
                # async generator less on every hop.
                if first.error is not None:
                    yield HopResult(request_id=si.request_id, error=first.error)
                    return
                own = self._own_frame(si, first, timing, more=False)
                if not first.next or first.next[0].stage_id in self._to_joins:
                    if first.next:  # a source of a join: its input goes back up to the collector
                        own.joins = [self._owned_input(first.next[0])]
                    timing.total_ms = (time.monotonic() - t0) * 1000.0
                    own.timings = [timing]
                    yield own
                    return
                downstream = self.hop.stream(first.next[0])
                try:
                    async for frame in downstream:
                        if frame.more:  # downstream streams: pass our part on first, then relay
                            if own.outputs:
                                yield msgspec.structs.replace(own, more=True)
                                own = HopResult(request_id=si.request_id)
                            yield frame
                            continue
                        timing.total_ms = (time.monotonic() - t0) * 1000.0
                        yield _merge(own, frame, timing)
                        return
                except HopUnavailable as exc:
                    yield _unavailable(si, exc)
                finally:
                    await downstream.aclose()  # (not contextlib.aclosing: on every hop)
                return
            async with contextlib.aclosing(self._merged(si, first, outputs, timing, t0)) as rest:
                async for frame in rest:
                    yield frame

    async def _merged(
        self,
        si: StageInput,
        first: StageOutput,
        outputs: AsyncIterator[StageOutput],
        timing: StageTiming,
        t0: float,
    ) -> AsyncGenerator[HopResult, None]:
        """The frames of an engine stream (or of an output with several next stages), as
        they come: each output's own part, and every branch's frames, merged."""
        held: dict[int, OutStream] = {}  # next stage -> its streamed input's later chunks
        try:
            async with contextlib.aclosing(self._frames(si, first, outputs, timing, t0, held)) as f:
                async for frame in f:
                    yield frame
        finally:
            for stage_id, stream in held.items():
                assert self.inputs is not None
                self.inputs.streams.close(si.request_id, stage_id, stream)

    async def _frames(
        self,
        si: StageInput,
        first: StageOutput,
        outputs: AsyncIterator[StageOutput],
        timing: StageTiming,
        t0: float,
        streamed: dict[int, OutStream],
    ) -> AsyncGenerator[HopResult, None]:
        async with FrameMerger(si.request_id) as merger:
            merger.spawn(self._feed(si, first, outputs, timing, merger, streamed))
            held: dict[int, dict[int, StageInput] | None] = {}  # join -> source -> input
            async with contextlib.aclosing(merger.frames()) as frames:
                async for frame in frames:
                    if frame.joins and self._collects:
                        frame = self._collect(frame, held, merger, first)
                        if not (frame.outputs or frame.joins or frame.error):
                            continue
                    yield frame
                    if frame.error is not None:
                        return
            waiting = {j: inputs for j, inputs in held.items() if inputs is not None}
            if waiting and not merger.failed:  # a branch ended without its join input
                yield _incomplete(si, waiting, self.pipeline)
                return
        if not merger.failed:
            timing.total_ms = (time.monotonic() - t0) * 1000.0
            yield HopResult(request_id=si.request_id, timings=[timing, *merger.timings])

    async def _feed(
        self,
        si: StageInput,
        out: StageOutput,
        outputs: AsyncIterator[StageOutput],
        timing: StageTiming,
        merger: FrameMerger,
        streamed: dict[int, OutStream],
    ) -> None:
        """Pass each engine output on as it comes: our final part as a frame, each next-stage
        input to a relay task of its own (a streamed input's later chunks: to ``streamed``)."""
        while True:
            if out.error is not None:
                merger.put(HopResult(request_id=si.request_id, error=out.error))
                return
            frame = self._own_frame(si, out, timing, more=True)
            if frame.outputs:
                merger.put(frame)
            for n in out.next:
                if n.stage_id in self._to_joins:
                    joins = [self._owned_input(n)]
                    merger.put(HopResult(request_id=si.request_id, joins=joins, more=True))
                elif n.stage_id in self._streamed and not is_whole(n) and self.inputs is not None:
                    self._hand_on_streamed(n, merger, streamed)
                else:
                    merger.spawn(self._relay(n, merger))
            nxt = await anext(outputs, None)  # the engine stream ends after its last output
            if nxt is None:
                return
            out = nxt

    def _hand_on_streamed(
        self, n: StageInput, merger: FrameMerger, streamed: dict[int, OutStream]
    ) -> None:
        """A chunk of a streamed input: the first hops (naming this sidecar), the later ones
        wait here for the replica that runs it to pull them."""
        assert self.inputs is not None
        if n.chunk == 0:
            streamed[n.stage_id] = self.inputs.streams.open(n.request_id, n.stage_id)
            n = msgspec.structs.replace(n, stream_from=self.inputs.address)
            merger.spawn(self._relay(n, merger))
            return
        held = streamed.get(n.stage_id)
        if held is not None:
            held.put(self._owned_input(n))

    async def _relay(self, n: StageInput, merger: FrameMerger) -> None:
        try:
            async with contextlib.aclosing(self.hop.stream(n)) as downstream:
                async for frame in downstream:
                    merger.put(frame)
        except HopUnavailable as exc:
            merger.put(_unavailable(n, exc))

    def _owned_input(self, n: StageInput) -> StageInput:
        """``n`` with its tensors copied out of the engine's slots (it outlives them)."""
        return msgspec.structs.replace(n, payload=owned(n.payload, self.engine.reader))

    def _collect(
        self,
        frame: HopResult,
        held: dict[int, dict[int, StageInput] | None],
        merger: FrameMerger,
        out: StageOutput,
    ) -> HopResult:
        """Keep the join inputs of ``frame`` that this runner collects; hand a join off once
        every source's input is here (``held[join]`` is None from then on). Returns the frame
        without them (other joins' inputs travel on up). A source's input seen again (a
        replayed branch regenerates it) is the same: ignored. The join is traced as a child
        of this stage's span (``out``'s next inputs carry it), like the branches."""
        passed: list[StageInput] = []
        for n in frame.joins:
            if n.stage_id not in self._collects:
                passed.append(n)
                continue
            inputs = held.setdefault(n.stage_id, {})
            if inputs is None:  # handed off already
                continue
            inputs.setdefault(n.from_stage, n)
            if len(inputs) < len(self.pipeline.stage(n.stage_id).sources):
                continue
            held[n.stage_id] = None
            try:
                join = join_input(self.pipeline, n.stage_id, inputs)
            except JoinInputError as exc:
                error = StageError(code="engine_error", message=str(exc), stage_id=n.stage_id)
                return HopResult(request_id=frame.request_id, error=error)
            if out.next:
                join.traceparent = out.next[0].traceparent
            merger.spawn(self._relay(join, merger))
        return msgspec.structs.replace(frame, joins=passed)

    def _own_frame(
        self, si: StageInput, out: StageOutput, timing: StageTiming, *, more: bool
    ) -> HopResult:
        """This stage's final part of ``out`` (if it has one; no timings: the last frame
        carries them); adds ``out`` to ``timing``."""
        timing.engine_ms += out.engine_ms
        timing.used_ms += out.used_ms
        timing.queue_ms += out.queue_ms
        timing.output_bytes += sum(payload_nbytes(n.payload) for n in out.next)
        frame = HopResult(request_id=si.request_id, more=more)
        if out.final is not None:
            frame.outputs = {self.stage_id: owned(out.final, self.engine.reader)}
            if out.chunk:
                frame.chunks = {self.stage_id: out.chunk}
        return frame


class FrameMerger:
    """Frames from several producer tasks, in arrival order, until every producer is done.

    The first error frame ends the merge (the other producers are cancelled); a producer that
    raises (this stage's engine died) makes :meth:`frames` raise it: the answer cannot be
    completed here and must be cut, so that the sender replays it elsewhere. Timings of
    passed-on frames are kept for the final frame; frames are passed on with ``more=True``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.timings: list[StageTiming] = []
        self._queue: asyncio.Queue[HopResult | BaseException | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed = False

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def put(self, frame: HopResult) -> None:
        self._queue.put_nowait(frame)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            logger.warning("request_id=%s: a branch failed: %r", self.request_id, exc)
            self._queue.put_nowait(exc)  # raised to the consumer: this answer cannot go on
        if not self._tasks:
            self._queue.put_nowait(None)

    async def frames(self) -> AsyncGenerator[HopResult, None]:
        while not self._failed:
            frame = await self._queue.get()
            if isinstance(frame, BaseException):
                self._failed = True
                raise frame
            if frame is None:
                if self._tasks:  # a sentinel from an earlier lull; producers remain
                    continue
                return
            if frame.error is not None:
                self._failed = True
                self.timings.extend(frame.timings)
                yield msgspec.structs.replace(frame, more=False)
                return
            self.timings.extend(frame.timings)
            if frame.outputs or frame.joins:
                yield msgspec.structs.replace(frame, timings=[], more=True)

    @property
    def failed(self) -> bool:
        return self._failed

    async def __aenter__(self) -> FrameMerger:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _merge(own: HopResult, downstream: HopResult, timing: StageTiming) -> HopResult:
    """This stage's frame and the downstream's last one, as one last frame."""
    outputs = {**own.outputs, **downstream.outputs}
    chunks = {**own.chunks, **downstream.chunks}
    return HopResult(
        request_id=own.request_id,
        outputs=outputs,
        chunks=chunks,
        timings=[timing, *downstream.timings],
        error=downstream.error,
        joins=downstream.joins,
    )


def _incomplete(
    si: StageInput, held: dict[int, dict[int, StageInput]], pipeline: PipelineSpec
) -> HopResult:
    """The error that ends a request whose branches ended without every join input."""
    join, inputs = min(held.items())
    missing = [s for s in pipeline.stage(join).sources if s not in inputs]
    message = f"join stage {join} got no input from stage(s) {missing}"
    logger.error("request_id=%s: %s", si.request_id, message)
    return HopResult(
        request_id=si.request_id,
        error=StageError(code="engine_error", message=message, stage_id=join),
    )


def _unavailable(si: StageInput, exc: HopUnavailable) -> HopResult:
    return HopResult(
        request_id=si.request_id,
        error=StageError(code=exc.code, message=str(exc), stage_id=exc.stage_id),
    )


class InputFeeds:
    """Streamed inputs in a stage pod (module docstring): those its runner holds for the next
    stage (``streams``, served by ``POST /v1/hop/input``) and the pulls that feed its engine."""

    def __init__(
        self, streams: InputStreams, address: str, on_fed: Callable[[], None] | None = None
    ) -> None:
        self.streams = streams
        self.address = address  # this sidecar, as the replicas that pull reach it
        self.on_fed = on_fed  # called for every chunk fed to the engine

    async def feed_engine(self, engine: EngineClient, hop: HopClient, si: StageInput) -> None:
        """Pull the later chunks of the streamed input ``si`` opened and hand each to the
        engine; a pull that fails ends the request with the reason."""
        key = transfer_key(si)
        timeout_s = max(0.1, si.deadline_ms / 1000.0 - time.time())
        try:
            await engine.submitted(key)  # the chunks follow their first on the channel
            async with contextlib.aclosing(
                pull_input(hop.http, si.stream_from, hop.auth_header, si, timeout_s)
            ) as chunks:
                async for chunk in chunks:
                    if not engine.holds(key):
                        return  # the request ended (or was left): the rest is not needed
                    await engine.feed(key, chunk)
                    if self.on_fed is not None:
                        self.on_fed()
        except EngineDeadError:
            pass  # the request fails with the engine
        except InputPullError as exc:
            logger.warning("request_id=%s: %s", si.request_id, exc)
            engine.fail(key, "unavailable", str(exc))
        except Exception as exc:  # a bad address, a frame that does not decode, …
            logger.exception("request_id=%s: feeding its streamed input failed", si.request_id)
            engine.fail(key, "engine_error", f"streamed input: {type(exc).__name__}: {exc}")
