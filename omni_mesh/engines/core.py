"""EngineCore: the inner loop of a stage's engine process, with no IO.

It turns a batch of :class:`StageInput` into :class:`StageOutput`: resolve inputs, run the
engine, apply the downstream stages' processors, and build every next-stage input with the
same request identity (invariants 1 and 2). How tensors are materialised (shared memory in the
process wrapper, plain bytes in tests) is injected as two callables.

Streams (``async_chunk``): the core opens one stream of results per admitted input
(:meth:`StageEngine.open`) and keeps the unfinished ones between steps, vLLM-style continuous
batching at chunk granularity: each :meth:`EngineCore.advance` admits a new batch, then advances
every running stream by one chunk. Chunk numbering rule:

* a *whole* input (chunk 0, ``last``) may stream: its outputs are chunks 0, 1, 2, … and only
  the final one has ``last=True``;
* a *chunk* of an upstream stream gets exactly one output, with the input's ``chunk`` and
  ``last`` (an engine result with ``last=False`` for it is an ``engine_error``);
* every next-stage input built from output chunk c carries ``chunk=c`` and the output's
  ``last``; except that a result with ``forward=False`` (a chunk for the client alone: a
  thinker's text as it is generated, its whole output on the last result) builds no next-stage
  input, and the next stages number the forwarded chunks among themselves (0, 1, …): a stream
  that forwards only its last result hands the next stage one whole input (``forward`` applies
  to the stream of a whole input; a chunk's one result always goes on).

A streamed input (a stage with ``stream_input``) is one request: its first chunk opens a stream
as a whole input does, and :meth:`EngineCore.feed` merges each later chunk into it between
steps (``engines/fed.py``).

A stream that stops without a ``last`` result, or raises in ``next()``, fails its request alone
(``engine_error``); an error output always ends the stream. Running streams whose deadline
passes are closed and answered with a ``deadline`` error; :meth:`EngineCore.abort` closes one.

An engine with its own scheduler (vLLM; the transformers talkers' frame batches) keeps every
request the sidecar handed in inside that scheduler: its ``before_step`` runs one scheduler step
(new requests join the running batch) and a stream whose request has no result yet yields
``None``: no output this step, the stream stays running (so a step may answer an admitted input
later than the step that admits it).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from omni_mesh.configs.pipeline_spec import PipelineSpec, StageSpec
from omni_mesh.data_plane.kv_transfer import is_prefill
from omni_mesh.data_plane.messages import (
    Payload,
    StageError,
    StageInput,
    StageOutput,
    Tensor,
    is_whole,
    opens_input_stream,
    transfer_key,
)
from omni_mesh.engines.admitted import AdmittedStream, share_step
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
from omni_mesh.engines.fed import EarlyChunks, FedRequest
from omni_mesh.engines.joins import JoinProcessorError, join_assembler

logger = logging.getLogger(__name__)


#: Resolves a payload tensor into a numpy array (zero-copy view where possible).
ArrayReader = Callable[[Tensor], np.ndarray]
#: Turns an output array into a wire tensor, owned on behalf of a work key (``transfer_key``).
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
        # A join's processor runs in the join's own engine, on every source's output.
        self._processors: dict[int, Processor | None] = {
            s.stage_id: (import_object(s.processor) if s.processor else None)
            for s in self.downstream
            if len(s.sources) == 1
        }
        self._processors.update({s.stage_id: None for s in self.downstream if len(s.sources) > 1})
        self._join = join_assembler(pipeline, stage)  # None unless this stage is a join
        # Each downstream stage and every stage after it (StageInput.final_stages).
        self._leads_to = {s.stage_id: _reachable(pipeline, s.stage_id) for s in self.downstream}
        self._running: list[AdmittedStream] = []
        # Later chunks of streamed inputs that came before their first chunk was admitted.
        self._early = EarlyChunks()

    @classmethod
    def build(cls, ctx: EngineContext) -> EngineCore:
        engine_cls = import_object(ctx.stage.engine)
        if not (isinstance(engine_cls, type) and issubclass(engine_cls, StageEngine)):
            raise TypeError(f"{ctx.stage.engine!r} is not a StageEngine subclass")
        chosen = engine_cls.engine_for(ctx)  # the stage's settings may pick another class
        if not (isinstance(chosen, type) and issubclass(chosen, StageEngine)):
            raise TypeError(f"{ctx.stage.engine!r} picked {chosen!r}, not a StageEngine subclass")
        return cls(ctx.pipeline, ctx.stage, chosen(ctx))

    @property
    def running(self) -> int:
        """Streams open between steps (requests whose engine has more chunks to give)."""
        return len(self._running)

    def abort(self, key: str) -> StageInput | None:
        """Close the running stream of the work ``key`` names (its input's ``transfer_key``:
        the request id, as only whole inputs stream); its input, or None when none runs."""
        self._early.pop(key)
        hit = [s for s in self._running if transfer_key(s.si) == key]
        self._running = [s for s in self._running if transfer_key(s.si) != key]
        for stream in hit:
            stream.close()
        return hit[0].si if hit else None

    def forget(self, key: str) -> None:
        """The work ``key`` was dropped before admission: its early chunks go too."""
        self._early.pop(key)

    def feed(self, key: str, si: StageInput, read: ArrayReader, *, queued: bool = False) -> None:
        """A later chunk of the streamed input of the work ``key``: merged into its running request,
        kept for it while it is ``queued``, else dropped (it ended or was aborted)."""
        stream = next((s for s in self._running if transfer_key(s.si) == key), None)
        if stream is None:
            if queued:
                self._early.keep(key, si)
        elif stream.fed is not None:
            stream.fed.take(si.chunk, si.last, functools.partial(self._to_data, si, read))

    def advance(
        self,
        batch: Sequence[tuple[StageInput, float]],
        read: ArrayReader,
        write: ArrayWriter,
    ) -> list[tuple[StageInput, StageOutput]]:
        """Admit a batch of (input, enqueue time), then advance every stream by one chunk.

        Returns the outputs of this step, each with the input it answers (its
        ``transfer_key`` names the work to the sidecar): deadline errors of running streams,
        then the next chunk of each stream admitted earlier (in admission order), then exactly
        one output per input of ``batch`` in its order (its first chunk, or its error). A
        whole-output engine thus answers each request in the step that admits it."""
        started = time.monotonic()
        outputs = self._expire(time.time() * 1000.0)
        t0 = time.monotonic()
        # 1) Resolve every input; a bad one fails alone, as data.
        resolved: list[tuple[StageInput, StageOutput] | None] = []  # an error, or None: admitted
        fresh: list[tuple[StageInput, EngineRequest, float]] = []
        for si, t_enqueued in batch:
            try:
                request = self._to_request(si, read)
            except (EngineInputError, ValueError) as exc:
                resolved.append((si, self._error(si, "bad_input", str(exc))))
                continue
            except JoinProcessorError as exc:
                logger.exception("join processor failed request_id=%s", si.request_id)
                resolved.append((si, self._error(si, "engine_error", str(exc))))
                continue
            resolved.append(None)
            fresh.append((si, request, max(0.0, (t0 - t_enqueued) * 1000.0)))
        # 2) Open the new streams, then advance every stream by one chunk.
        opened = iter(self._open(fresh, read))
        slots = [next(opened) if slot is None else slot for slot in resolved]
        earlier = self._running
        streams = earlier + [s for s in slots if isinstance(s, AdmittedStream)]
        results = self._advance_all(streams)
        engine_ms = (time.monotonic() - t0) * 1000.0
        # 3) Build outputs and next-stage inputs; keep the streams that have more to give.
        produced: dict[int, StageOutput] = {}
        self._running = []
        for stream, result in zip(streams, results, strict=True):
            if result is None:  # nothing yet: the engine's scheduler still runs the request
                self._running.append(stream)
                continue
            out = self._emit(stream, result, write, engine_ms)
            produced[id(stream)] = out
            if out.error is None and stream.whole and not out.last:  # a chunk's one output ends it
                self._running.append(stream)
            else:
                stream.close()
        share_step(streams, produced, started)
        outputs += [(s.si, produced[id(s)]) for s in earlier if id(s) in produced]
        outputs += [
            slot if isinstance(slot, tuple) else (slot.si, produced[id(slot)])
            for slot in slots
            if isinstance(slot, tuple) or id(slot) in produced
        ]
        return outputs

    # ---- helpers -------------------------------------------------------------------------

    def _expire(self, now_ms: float) -> list[tuple[StageInput, StageOutput]]:
        """Close the running streams whose deadline passed; answer each with the reason."""
        expired = [s for s in self._running if s.si.deadline_ms < now_ms]
        if not expired:
            return []
        self._running = [s for s in self._running if s.si.deadline_ms >= now_ms]
        outputs = []
        for stream in expired:
            stream.close()
            message = "the request's deadline passed while the engine was streaming its output"
            outputs.append(
                (stream.si, self._error(stream.si, "deadline", message, stream.next_chunk))
            )
        return outputs

    def _open(
        self, fresh: list[tuple[StageInput, EngineRequest, float]], read: ArrayReader
    ) -> list[tuple[StageInput, StageOutput] | AdmittedStream]:
        """One stream per request (or, when the engine refuses the batch, one error each)."""
        if not fresh:
            return []
        try:
            iterators = self.engine.open([request for _, request, _ in fresh])
            if len(iterators) != len(fresh):
                raise RuntimeError(
                    f"open() gave {len(iterators)} streams for {len(fresh)} requests"
                )
        except EngineInputError as exc:
            # The engine could not say which request was bad: fail the batch as bad input.
            return [(si, self._error(si, "bad_input", str(exc))) for si, _, _ in fresh]
        except Exception as exc:
            # A failed step fails its batch, as data; the engine keeps serving the next one.
            logger.exception(
                "engine step failed stage=%d batch=%d", self.stage.stage_id, len(fresh)
            )
            message = f"{type(exc).__name__}: {exc}"
            return [(si, self._error(si, "engine_error", message)) for si, _, _ in fresh]
        streams: list[tuple[StageInput, StageOutput] | AdmittedStream] = []
        for (si, request, queue_ms), it in zip(fresh, iterators, strict=True):
            stream = AdmittedStream(si, it, queue_ms)
            if request.streamed_input:
                fed = stream.fed = FedRequest(request)
                for early in self._early.pop(transfer_key(si)):
                    fed.take(early.chunk, early.last, functools.partial(self._to_data, early, read))
            streams.append(stream)
        return streams

    def _advance_all(
        self, streams: list[AdmittedStream]
    ) -> list[EngineResult | StageOutput | None]:
        if not streams:
            return []
        try:
            self.engine.before_step(len(streams))
        except Exception as exc:
            logger.exception("engine before_step failed stage=%d", self.stage.stage_id)
            message = f"{type(exc).__name__}: {exc}"
            return [self._error(s.si, "engine_error", message, s.next_chunk) for s in streams]
        return [self._advance(stream) for stream in streams]

    def _advance(self, stream: AdmittedStream) -> EngineResult | StageOutput | None:
        """The stream's next result (None: none this step), or the error that ends it (as
        data, for it alone)."""
        si, chunk = stream.si, stream.next_chunk
        if stream.fed is not None and stream.fed.error:
            return self._error(si, "bad_input", stream.fed.error, chunk)
        try:
            result = next(stream.results)
        except StopIteration:
            if stream.emitted == 0:
                return self._error(si, "engine_error", "engine returned no result")
            message = f"engine's stream ended after chunk {chunk - 1} without a last result"
            return self._error(si, "engine_error", message, chunk)
        except EngineInputError as exc:
            return self._error(si, "bad_input", str(exc), chunk)
        except Exception as exc:
            logger.exception(
                "engine stream failed request_id=%s stage=%d chunk=%d",
                si.request_id,
                self.stage.stage_id,
                chunk,
            )
            return self._error(si, "engine_error", f"{type(exc).__name__}: {exc}", chunk)
        if result is None:
            return None
        if result.error is None and not stream.whole and not result.last:
            message = f"engine gave more than one result for chunk {si.chunk} of an upstream stream"
            return self._error(si, "engine_error", message, chunk)
        return result

    def _emit(
        self,
        stream: AdmittedStream,
        result: EngineResult | StageOutput,
        write: ArrayWriter,
        engine_ms: float,
    ) -> StageOutput:
        """Number the result per the chunk rule (module docstring) and build its output."""
        if isinstance(result, StageOutput):
            return result
        si = stream.si
        chunk, last = (stream.emitted, result.last) if stream.whole else (si.chunk, si.last)
        queue_ms = stream.queue_ms if stream.emitted == 0 else 0.0
        stream.emitted += 1
        forward = result.forward or last or result.error is not None or not stream.whole
        next_chunk = stream.forwarded if stream.whole else si.chunk
        stream.forwarded += forward
        try:
            return self._to_output(
                si, result, write, engine_ms, queue_ms, chunk, last, next_chunk if forward else None
            )
        except OutputCapacityError as exc:
            return self._error(si, "unavailable", str(exc), chunk)

    def _to_request(self, si: StageInput, read: ArrayReader) -> EngineRequest:
        streamed = opens_input_stream(si)
        where = f"stage {self.stage.stage_id} ({self.stage.name})"
        if streamed and not self.stage.stream_input:
            raise EngineInputError(f"{where} takes no streamed input")
        if self.stage.stream_input and not (streamed or is_whole(si)):
            raise EngineInputError(
                f"{where} takes its input whole or as a stream: chunk {si.chunk} came alone "
                "(no stream_from)"
            )
        return EngineRequest(
            request_id=si.request_id,
            seed=si.seed,
            data=self._to_data(si, read),
            sampling=si.sampling,
            chunk=si.chunk,
            last=si.last,
            kv_transfer=si.kv_transfer,
            streamed_input=streamed,
        )

    def _to_data(self, si: StageInput, read: ArrayReader) -> StageData:
        arrays = {}
        for name, t in si.payload.tensors.items():
            try:
                arrays[name] = read(t)
            except ValueError as exc:
                raise EngineInputError(
                    f"stage {self.stage.stage_id} ({self.stage.name}): tensor {name!r}: {exc}"
                ) from None
        data = StageData(fields=dict(si.payload.fields), arrays=arrays)
        if self._join is not None:
            data = self._join(data)
        return data

    def _to_output(
        self,
        si: StageInput,
        result: EngineResult,
        write: ArrayWriter,
        engine_ms: float,
        queue_ms: float,
        chunk: int,
        last: bool,
        next_chunk: int | None,
    ) -> StageOutput:
        """``result`` as the output numbered ``chunk``; its next-stage inputs carry
        ``next_chunk`` (None: the result builds none)."""
        if result.error is not None:
            return self._error(si, "bad_input", result.error, chunk)
        if is_prefill(si.kv_transfer):  # a split stage's prefill answers where its KV waits, only
            result = EngineResult(result.request_id, kv_transfer=result.kv_transfer)
            next_chunk = None
        owner = transfer_key(si)  # the sidecar releases the slots by the work's key
        # One slot per array, however many consumers. The arrays are kept alive with their
        # tensors: a freed array's id() may be reused by the next processor's new array.
        written: dict[int, tuple[np.ndarray, Tensor]] = {}

        def payload(data: StageData) -> Payload:
            tensors: dict[str, Tensor] = {}
            for name, arr in data.arrays.items():
                key = id(arr)
                if key not in written:
                    written[key] = (arr, write(arr, owner))
                tensors[name] = written[key][1]
            return Payload(fields=dict(data.fields), tensors=tensors)

        final = payload(result.final) if result.final is not None else None
        nexts = []
        for spec in self.downstream if next_chunk is not None else ():
            assert next_chunk is not None
            if si.final_stages and self._leads_to[spec.stage_id].isdisjoint(si.final_stages):
                continue  # nothing the client wants comes from there
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
                    chunk,
                )
            nexts.append(
                StageInput(
                    pipeline=si.pipeline,
                    request_id=si.request_id,
                    stage_id=spec.stage_id,
                    from_stage=self.stage.stage_id,
                    chunk=next_chunk,
                    last=last,
                    attempt=0,
                    deadline_ms=si.deadline_ms,
                    seed=si.seed,
                    traceparent=si.traceparent,
                    sampling=si.sampling,
                    payload=payload(data),
                    priority=si.priority,  # every stage's admission queue orders by them
                    tenant=si.tenant,
                    affinity=si.affinity,  # the request's hops keep to one replica per stage
                    final_stages=si.final_stages,
                )
            )
        return StageOutput(
            request_id=si.request_id,
            stage_id=self.stage.stage_id,
            chunk=chunk,
            last=last,
            final=final,
            next=nexts,
            engine_ms=engine_ms,
            queue_ms=queue_ms,
            kv_transfer=result.kv_transfer,
        )

    def _error(
        self, si: StageInput, code: str, message: str, chunk: int | None = None
    ) -> StageOutput:
        """A failed output; it ends the request's stream (``last``). ``chunk`` defaults to the
        input's own (the first output of a whole input is chunk 0)."""
        chunk = si.chunk if chunk is None else chunk
        logger.info(
            "request failed request_id=%s stage=%d chunk=%d code=%s: %s",
            si.request_id,
            self.stage.stage_id,
            chunk,
            code,
            message,
        )
        return StageOutput(
            request_id=si.request_id,
            stage_id=self.stage.stage_id,
            chunk=chunk,
            last=True,
            error=StageError(code=code, message=message, stage_id=self.stage.stage_id),  # type: ignore[arg-type]
        )


def _reachable(pipeline: PipelineSpec, stage_id: int) -> frozenset[int]:
    """``stage_id`` and every stage downstream of it."""
    seen = {stage_id}
    todo = [stage_id]
    while todo:
        for nxt in pipeline.downstream(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return frozenset(seen)
