"""``n`` choices of one OpenAI text request: n requests through the pipeline, merged.

Each choice is a request of its own (its own id, its own hops, replayed on its own), seeded
``seed + i`` when the client gives a seed, so the same seed gives the same n choices; without a
seed each choice draws its own. (vLLM's own ``n`` would give n sequences of one request, which a
multi-stage pipeline has no way to carry stage to stage; n requests work for every pipeline.)

:func:`collect_choices` answers a unary request: every choice's final outputs, the first failure
cancelling the others. :func:`respond_choices` streams: the choices' answer frames as they come,
each chunk handed to the sink with its choice index, a choice's last event as soon as it ends,
then the sink's tail; an error before the first byte is an ordinary 4xx/5xx, after it an error
event. Leaving early (the client went away, an error) closes every choice's frames, which
aborts them upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Protocol

import msgspec
from aiohttp import web

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane.messages import HopResult, Prompt
from omni_mesh.sidecar.api.client_requests import collect
from omni_mesh.sidecar.api.outputs import ChunkAssembler, FinalOutput, OutputChunk, joined_off_loop
from omni_mesh.sidecar.api.sinks import _LazyResponse, stream_failed
from omni_mesh.sidecar.errors import ApiError, from_stage_error

logger = logging.getLogger(__name__)

Frames = AsyncGenerator[HopResult, None]
_SEED_SPAN = 1 << 63


def choice_prompts(prompt: Prompt, n: int) -> list[Prompt]:
    """The prompt of each of ``n`` choices: seeded ``seed + i`` when a seed is given."""
    if n == 1 or prompt.seed is None:
        return [prompt] * n
    return [msgspec.structs.replace(prompt, seed=(prompt.seed + i) % _SEED_SPAN) for i in range(n)]


async def collect_choices(pipeline: PipelineSpec, streams: list[Frames]) -> list[list[FinalOutput]]:
    """Every choice's final outputs (see :func:`collect`); the first error cancels the rest."""
    if len(streams) == 1:
        return [await collect(pipeline, streams[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(collect(pipeline, s)) for s in streams]
    except BaseExceptionGroup as group_error:
        raise group_error.exceptions[0] from None
    return [t.result() for t in tasks]


class ChoiceSink(Protocol):
    """What a text route streams for its choices (always SSE events)."""

    content_type: str

    def piece(self, index: int, chunk: OutputChunk) -> bytes:
        """The event(s) for one of choice ``index``'s output chunks, in order."""
        ...

    def end(self, index: int, outputs: list[FinalOutput]) -> bytes:
        """Choice ``index``'s last event(s) (its ``finish_reason``), its outputs joined."""
        ...

    def tail(self, choices: list[list[FinalOutput]]) -> bytes:
        """The stream's last bytes (usage when asked, ``[DONE]``)."""
        ...

    def error_event(self, err: ApiError) -> bytes: ...


async def _merged(
    streams: list[Frames],
) -> AsyncGenerator[tuple[int, HopResult | None], None]:
    """The choices' frames as they come, tagged with the choice index; ``(i, None)`` when
    choice i's frames end. Every stream is closed when this iterator closes."""
    queue: asyncio.Queue[tuple[int, HopResult | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, frames: Frames) -> None:
        try:
            async with contextlib.aclosing(frames) as stream:
                async for frame in stream:
                    await queue.put((index, frame))
            await queue.put((index, None))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            left -= item is None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pieces(sink: ChoiceSink, index: int, chunks: list[OutputChunk]) -> bytes:
    """What ``sink`` sends for choice ``index``'s ``chunks``; in a worker thread when the sink
    encodes media (``encodes``: an image sink's PNG previews)."""
    if not chunks:
        return b""
    if getattr(sink, "encodes", False):
        return await asyncio.to_thread(lambda: b"".join(sink.piece(index, c) for c in chunks))
    return b"".join(sink.piece(index, c) for c in chunks)


async def respond_choices(
    request: web.Request,
    pipeline: PipelineSpec,
    streams: list[Frames],
    sink: ChoiceSink,
) -> web.StreamResponse:
    """Stream the choices' answers through ``sink`` (see the module docstring)."""
    assemblers = [ChunkAssembler(pipeline) for _ in streams]
    finals: list[list[FinalOutput]] = [[] for _ in streams]
    out = _LazyResponse(request, sink)  # type: ignore[arg-type]  # always_stream: never unary
    try:
        async with contextlib.aclosing(_merged(streams)) as merged:
            async for index, frame in merged:
                assembler = assemblers[index]
                if frame is None:  # this choice's frames ended
                    error = assembler.end()
                    if error is not None:
                        raise from_stage_error(error)
                    finals[index] = await joined_off_loop(assembler)
                    await out.write(sink.end(index, finals[index]))
                    continue
                ready = assembler.add(frame)
                if assembler.error is not None:
                    raise from_stage_error(assembler.error)
                await out.write(await _pieces(sink, index, ready))
        await out.write(sink.tail(finals))
        return await out.finish()
    except Exception as exc:
        if out.response is None:
            raise
        return await stream_failed(request, out, exc)
