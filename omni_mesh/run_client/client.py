"""The reference ``/v1/run`` client: run a pipeline one stage call at a time (DESIGN §5).

The client sends the entry stage the prompt object, then follows each answer: ``next_stage_id``
+ ``stage_input`` to the next stage, ``next: [...]`` to several stages at once, until only
outputs remain. It never looks inside the opaque ``stage_input``; it hands it back as it came
(a base64 string in JSON mode, raw bytes in msgpack mode).

With ``async_chunk`` a stage that streams answers one next input per output chunk (several
``next`` entries for the same stage). The client runs all of them concurrently, at most
:data:`MAX_PARALLEL_CALLS` calls of a run at a time, and joins each stage's outputs in the
order of the ``chunk`` its calls report: the PCM of audio chunks into one WAV, text and data
concatenated (:func:`omni_mesh.run_client.outputs.join_run_outputs`).

A join stage (several sources) is called once, with ``stage_inputs``: the client holds each
source's ``next`` entry for it until every source has answered, then sends them together in the
pipeline's source order.

Where each call goes is a :class:`StageResolver`: :class:`FixedUrls` (API servers, which accept
every stage and forward), :class:`StageUrls` (one URL per stage) or
:class:`ControlPlaneDiscovery` (a healthy replica of the stage, found through ``omni-cp``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType

import aiohttp

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane import codec
from omni_mesh.data_plane.constants import JSON, MSGPACK
from omni_mesh.data_plane.messages import (
    Prompt,
    RunOutputBin,
    RunResponse,
    RunResponseBin,
    SamplingParams,
)
from omni_mesh.run_client.bodies import (
    Answer,
    Opaque,
    StageInputValue,
    decode_answer,
    encode_call,
    error_message,
)
from omni_mesh.run_client.errors import DiscoveryError, RunClientError, StageCallError
from omni_mesh.run_client.outputs import join_run_outputs, output_paths, write_outputs
from omni_mesh.run_client.resolvers import (
    ControlPlaneDiscovery,
    FixedUrls,
    StageResolver,
    StageUrls,
)

__all__ = [
    "MAX_PARALLEL_CALLS",
    "ControlPlaneDiscovery",
    "DiscoveryError",
    "FixedUrls",
    "RunClient",
    "RunClientError",
    "RunTrace",
    "StageCall",
    "StageCallError",
    "StageResolver",
    "StageUrls",
    "error_message",
    "output_paths",
    "write_outputs",
]

logger = logging.getLogger(__name__)

#: A run that makes more calls than this many per stage is a server bug; stop it. (A stream
#: has at most 1024 chunks; next inputs must go to a stage that takes the caller's output, so
#: a run cannot loop.)
MAX_CALLS_PER_STAGE = 2048
#: Calls of one run in flight at once (the chunks of a streaming stage).
MAX_PARALLEL_CALLS = 4


# ---- what a run yields -------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCall:
    """One ``/v1/run`` call of a run, as it happened."""

    index: int  # 1-based, in completion order
    stage_id: int
    stage_name: str
    url: str
    seconds: float
    request_bytes: int
    response_bytes: int
    next_inputs: tuple[tuple[int, int], ...]  # (stage id, size of its opaque input in bytes)
    outputs: Mapping[int, RunOutputBin]  # this call's: the chunk it ran
    chunk: int = 0  # the chunk of the request the call ran (0: a whole input, or the first)
    streamed: bool = False  # the call ran one of several chunks of a stream

    @property
    def next_input_bytes(self) -> int:
        return sum(size for _, size in self.next_inputs)


@dataclass
class RunTrace:
    """A finished run: its calls and the final outputs by stage id (media as raw bytes; a
    streamed stage's chunks joined)."""

    request_id: str = ""
    calls: list[StageCall] = field(default_factory=list)
    outputs: dict[int, RunOutputBin] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class _Run:
    """One run in progress: its trace, its output chunks, the inputs held for join stages
    (join -> source -> its input) and its bound on parallel calls."""

    trace: RunTrace
    limit: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_PARALLEL_CALLS))
    chunks: dict[int, dict[int, RunOutputBin]] = field(default_factory=dict)
    joins: dict[int, dict[int, Opaque]] = field(default_factory=dict)


# ---- the client --------------------------------------------------------------------------------


class RunClient:
    """Loops ``/v1/run`` across the stages of ``pipeline``; reusable across runs.

    ``on_call`` is called after each call (progress output). :meth:`close` (or leaving
    ``async with``) closes the resolver and the HTTP session, unless the session was passed in.
    """

    def __init__(
        self,
        pipeline: PipelineSpec,
        resolver: StageResolver,
        *,
        msgpack: bool = False,
        timeout_s: float = 300.0,
        on_call: Callable[[StageCall], None] | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.resolver = resolver
        self.msgpack = msgpack
        self.on_call = on_call
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> RunClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.resolver.close()
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self, prompt: Prompt, sampling: SamplingParams | None = None) -> RunTrace:
        """Run the whole pipeline on ``prompt``; raise :class:`RunClientError` on failure.

        ``sampling`` goes with the entry call; the opaque inputs of later stages carry it."""
        run = _Run(RunTrace())
        start = time.perf_counter()
        await self._hop(run, self.pipeline.entry_stage_id, prompt, sampling)
        for join, inputs in sorted(run.joins.items()):
            sources = self.pipeline.stage(join).sources
            raise RunClientError(
                f"stage {join} is a join of stages {list(sources)} but only stage(s) "
                f"{sorted(inputs)} gave an input for it"
            )
        run.trace.outputs = _joined(run.chunks)
        run.trace.seconds = time.perf_counter() - start
        return run.trace

    # ---- one call and what follows it --------------------------------------------------------

    async def _hop(
        self,
        run: _Run,
        stage_id: int,
        stage_input: StageInputValue,
        sampling: SamplingParams | None = None,
        *,
        streamed: bool = False,
    ) -> None:
        trace = run.trace
        if len(trace.calls) >= MAX_CALLS_PER_STAGE * len(self.pipeline.stages):
            raise RunClientError(
                f"stopped after {len(trace.calls)} calls: the stages keep returning next inputs"
            )
        body = encode_call(stage_id, stage_input, sampling, msgpack=self.msgpack)
        async with run.limit:
            url = await self.resolver.url_for(stage_id)
            t0 = time.perf_counter()
            raw = await self._post(stage_id, url, body)
            seconds = time.perf_counter() - t0
        answer = self._decode(stage_id, url, raw)
        trace.request_id = trace.request_id or answer.request_id
        for k, out in answer.outputs.items():
            run.chunks.setdefault(k, {})[answer.chunk] = out
        call = StageCall(
            index=len(trace.calls) + 1,
            stage_id=stage_id,
            stage_name=self.pipeline.stage(stage_id).name,
            url=url,
            seconds=seconds,
            request_bytes=len(body),
            response_bytes=len(raw),
            next_inputs=tuple((k, len(v)) for k, v in answer.next),
            outputs=answer.outputs,
            chunk=answer.chunk,
            streamed=streamed,
        )
        trace.calls.append(call)
        logger.debug(
            "run call stage=%d chunk=%d url=%s seconds=%.3f",
            stage_id,
            answer.chunk,
            url,
            seconds,
        )
        if self.on_call is not None:
            self.on_call(call)
        nexts = self._ready(run, stage_id, answer.next)
        if len(nexts) == 1:
            await self._hop(run, *nexts[0])
        elif nexts:
            await self._fan_out(run, nexts)

    def _ready(
        self, run: _Run, stage_id: int, nexts: list[tuple[int, Opaque]]
    ) -> list[tuple[int, StageInputValue]]:
        """The calls ``nexts`` make ready: each next stage's input, except that a join's is
        held until every source's has come; then the join's inputs, in source order."""
        ready: list[tuple[int, StageInputValue]] = []
        for k, value in nexts:
            sources = self.pipeline.stage(k).sources
            if len(sources) == 1:
                ready.append((k, value))
                continue
            held = run.joins.setdefault(k, {})
            if stage_id in held:
                raise RunClientError(
                    f"stage {stage_id} gave more than one input for join stage {k} "
                    "(a join takes one whole input per source)"
                )
            held[stage_id] = value
            if len(held) == len(sources):
                del run.joins[k]
                ready.append((k, [held[s] for s in sources]))
        return ready

    async def _fan_out(self, run: _Run, branches: list[tuple[int, StageInputValue]]) -> None:
        """Every next input at once (bounded by the run's limit): the branches of a fan-out
        and the chunks of a stream alike."""
        per_stage = Counter(k for k, _ in branches)
        try:
            async with asyncio.TaskGroup() as group:
                for stage_id, stage_input in branches:
                    streamed = per_stage[stage_id] > 1
                    group.create_task(self._hop(run, stage_id, stage_input, streamed=streamed))
        except BaseExceptionGroup as eg:
            raise _first_leaf(eg) from None

    async def _post(self, stage_id: int, url: str, body: bytes) -> bytes:
        ctype = MSGPACK if self.msgpack else JSON
        headers = {"Content-Type": ctype, "Accept": ctype}
        session = self._get_session()
        try:
            async with session.post(
                f"{url}/v1/run", data=body, headers=headers, timeout=self._timeout
            ) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise self._error(stage_id, url, resp.status, error_message(raw))
                return raw
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._error(stage_id, url, None, str(exc) or type(exc).__name__) from exc

    def _decode(self, stage_id: int, url: str, raw: bytes) -> Answer:
        try:
            answer = decode_answer(
                codec.decode(raw, RunResponseBin)
                if self.msgpack
                else codec.decode_json(raw, RunResponse)
            )
            if answer.stage_id != stage_id:
                raise ValueError(f"answer is for stage {answer.stage_id}, not {stage_id}")
            unknown = [k for k, _ in answer.next if k not in self.pipeline.stage_ids]
            if unknown:
                raise ValueError(f"answer names unknown next stage(s) {unknown}")
            wrong = [k for k, _ in answer.next if stage_id not in self.pipeline.stage(k).sources]
            if wrong:
                raise ValueError(f"answer names stage(s) {wrong}, which do not follow {stage_id}")
        except ValueError as exc:  # CodecError included
            detail = exc.detail if isinstance(exc, codec.CodecError) else str(exc)
            raise self._error(stage_id, url, 200, f"unusable answer: {detail}") from exc
        return answer

    def _error(self, stage_id: int, url: str, status: int | None, message: str) -> StageCallError:
        name = self.pipeline.stage(stage_id).name
        return StageCallError(f"stage {stage_id} ({name})", url, status, message)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session


# ---- answers, both encodings -------------------------------------------------------------------


def _joined(chunks: Mapping[int, Mapping[int, RunOutputBin]]) -> dict[int, RunOutputBin]:
    outputs: dict[int, RunOutputBin] = {}
    for stage_id, parts in sorted(chunks.items()):
        if sorted(parts) != list(range(len(parts))):
            raise RunClientError(
                f"stage {stage_id}: output chunks {sorted(parts)} have a gap (a call is missing)"
            )
        try:
            outputs[stage_id] = join_run_outputs([parts[c] for c in range(len(parts))])
        except ValueError as exc:
            raise RunClientError(f"stage {stage_id}: cannot join its output chunks: {exc}") from exc
    return outputs


def _first_leaf(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    first = eg.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
