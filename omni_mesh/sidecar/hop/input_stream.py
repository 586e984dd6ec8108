"""Streamed inputs between sidecars: a stage whose spec has ``stream_input`` (qwen3-omni's talker)
takes its source's chunks as one request that starts on the first chunk.

The sender's runner hands the first chunk on as an ordinary hop, with ``stream_from`` set to its
own address, and keeps the later chunks here (:class:`InputStreams`), in order, for as long as
it runs the request. The replica that runs the request pulls them (:func:`pull_input`:
``POST /v1/hop/input``, an answer of frames, one :class:`StageInput` each, sent as they come)
and feeds them to its engine. Custody stays with the sender (invariant 3): a replay of the first
chunk on another replica (its replica died mid-stream) pulls from the first later chunk again,
and a sender that dies takes its stream with it, as it takes the hop it was answering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta, Struct

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.constants import HOP_FRAMES, MSGPACK
from omni_mesh.data_plane.messages import RequestId, StageId, StageInput
from omni_mesh.sidecar.hop.answers import error_message
from omni_mesh.sidecar.hop.http import HopConnectionError, HopHttpClient

logger = logging.getLogger(__name__)

INPUT_PATH = "/v1/hop/input"
#: The most bytes one pulled chunk may take.
MAX_CHUNK_BYTES = 1 << 30


class InputPull(Struct, forbid_unknown_fields=True):
    """``POST /v1/hop/input`` body: the chunks from ``from_chunk`` on of the streamed input of
    ``request_id`` for stage ``stage_id``."""

    request_id: RequestId
    stage_id: StageId
    from_chunk: Annotated[int, Meta(ge=1)] = 1


class InputPullError(ConnectionError):
    """The streamed input cannot be pulled (its sender is gone, or no longer holds it)."""


@dataclass(eq=False)
class OutStream:
    """The later chunks of one streamed input, kept by its sender (module docstring)."""

    chunks: list[StageInput] = field(default_factory=list)  # chunk c at index c - 1
    ended: bool = False  # the last chunk is in, or the sender stopped holding it
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, si: StageInput) -> None:
        self.chunks.append(si)
        self.ended = self.ended or si.last
        self._wake()

    def drop(self) -> None:
        """The sender stopped: pullers see the stream end (without its last chunk, unless it
        came)."""
        self.ended = True
        self._wake()

    @property
    def complete(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].last

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def after(self, first: int) -> AsyncIterator[StageInput]:
        """Chunks ``first, first + 1, …`` as they come, until the stream ends."""
        index = first - 1
        while True:
            if index < len(self.chunks):
                yield self.chunks[index]
                index += 1
                continue
            if self.ended:
                return
            await self.changed.wait()


class InputStreams:
    """The streamed inputs this sidecar's runners hold, by (request, receiving stage)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], OutStream] = {}

    def open(self, request_id: str, stage_id: int) -> OutStream:
        stream = OutStream()
        old = self._held.get((request_id, stage_id))
        if old is not None:  # an earlier run of the same request here: it is over
            old.drop()
        self._held[(request_id, stage_id)] = stream
        return stream

    def close(self, request_id: str, stage_id: int, stream: OutStream) -> None:
        if self._held.get((request_id, stage_id)) is stream:
            del self._held[(request_id, stage_id)]
        stream.drop()

    def get(self, request_id: str, stage_id: int) -> OutStream | None:
        return self._held.get((request_id, stage_id))

    def __len__(self) -> int:
        return len(self._held)


async def pull_input(
    http: HopHttpClient,
    address: str,
    headers: dict[str, str],
    si: StageInput,
    timeout_s: float,
) -> AsyncGenerator[StageInput, None]:
    """The later chunks of the streamed input ``si`` opened (its chunk 0), from its sender at
    ``address``, in order, up to the last one. Raises :class:`InputPullError` when they cannot
    all be had."""
    body = codec.encode(InputPull(request_id=si.request_id, stage_id=si.stage_id))
    try:
        answer = await http.post(
            address,
            INPUT_PATH,
            body,
            {**headers, "Content-Type": MSGPACK},
            timeout_s=timeout_s,
            max_bytes=MAX_CHUNK_BYTES,
            stream_type=HOP_FRAMES,
        )
    except (HopConnectionError, TimeoutError, OSError, ValueError) as exc:
        raise InputPullError(f"streamed input from {address}: {type(exc).__name__}: {exc}") from exc
    if answer.frames is None:
        raise InputPullError(
            f"streamed input from {address}: HTTP {answer.status}: {error_message(answer.body)}"
        )
    expected = 1
    try:
        async with answer.frames as frames:
            async for raw in frames:
                chunk = codec.decode(raw, StageInput)
                if chunk.chunk != expected or chunk.request_id != si.request_id:
                    raise InputPullError(
                        f"streamed input from {address}: got {chunk.request_id}/{chunk.chunk} "
                        f"where chunk {expected} was due"
                    )
                expected += 1
                yield chunk
                if chunk.last:
                    return
    except (HopConnectionError, TimeoutError, OSError, ValueError) as exc:
        raise InputPullError(f"streamed input from {address}: {type(exc).__name__}: {exc}") from exc
    raise InputPullError(f"streamed input from {address}: ended before its last chunk")
