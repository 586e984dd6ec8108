"""One request's work on the engine, as the sidecar sees it: its outputs' mailbox
(:class:`Work`) and the async iterator its caller reads them from (:class:`EngineRun`). The
engine client (``client.py``) submits and aborts; this module holds no process or socket."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from omni_mesh.data_plane.messages import StageInput, StageOutput


class Submitter(Protocol):
    """What an :class:`EngineRun` needs of the engine client."""

    async def submit(self, si: StageInput) -> tuple[str, Work]: ...

    def leave(self, key: str, work: Work) -> None: ...


class Mailbox:
    """One work's outputs in arrival order, for its one reader (an ``asyncio.Queue`` does the
    same with far more machinery, built on every hop)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[StageOutput | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: StageOutput | BaseException) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> StageOutput | BaseException:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


@dataclass
class Work:
    """One submitted input: its outputs in order (or the error that ended it) in ``mailbox``.
    A whole input may stream several chunks; a chunk of an upstream stream gets one output."""

    whole: bool
    mailbox: Mailbox = field(default_factory=Mailbox)
    answered: bool = False  # its last output came (the engine is done with its inputs)
    delivered: int = 0  # outputs put in the mailbox so far
    on_aborted: Callable[[str], None] | None = None  # see EngineClient.when_aborted

    def ends_with(self, out: StageOutput) -> bool:
        return out.error is not None or out.last or not self.whole


class EngineRun:
    """One request's outputs from the engine (:meth:`EngineClient.stream`): an async iterator
    with ``aclose``, a class rather than an async generator (it runs on every hop)."""

    __slots__ = ("_client", "_closed", "_ended", "_key", "_loop", "_si", "_work")

    def __init__(self, client: Submitter, si: StageInput) -> None:
        self._client = client
        self._si = si
        self._key = ""
        self._work: Work | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended = False  # no more outputs to read (or none ever: submission failed)
        self._closed = False  # the caller left

    def __aiter__(self) -> EngineRun:
        return self

    async def __anext__(self) -> StageOutput:
        if self._ended or self._closed:
            raise StopAsyncIteration
        work = self._work
        if work is None:
            self._ended = True  # until the submission is made: nothing to leave
            self._loop = asyncio.get_running_loop()
            self._key, work = await self._client.submit(self._si)
            self._work, self._ended = work, False
            if self.left():  # closed while it was being submitted
                self._leave()
                raise StopAsyncIteration
        try:
            item = await work.mailbox.get()
        except BaseException:  # cancelled: the caller left
            self.close()
            raise
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        self._ended = work.ends_with(item)
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Leave before the last output: the engine aborts the work (nothing if it ended)."""
        self._closed = True
        self._leave()

    def left(self) -> bool:
        """Whether the caller closed it."""
        return self._closed

    def _leave(self) -> None:
        if not self._ended and self._work is not None:
            self._ended = True
            self._client.leave(self._key, self._work)

    def __del__(self) -> None:
        # Dropped unfinished (an async generator's finalizer did this): abort on the engine,
        # in the loop's thread (a collection may run this in any thread).
        loop, work = self._loop, self._work
        if self._ended or work is None or loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._client.leave, self._key, work)
