"""A request's outputs from the engine (``engine_link/work.py``, :class:`EngineRun`) against a
fake engine client (the far side of one boundary): it submits on the first read, ends after
the last output or an error, and aborts the work (``leave``) whenever its caller leaves early
— closed, cancelled, closed while being submitted, or dropped unfinished."""

from __future__ import annotations

import asyncio
import gc

import pytest

from omni_mesh.data_plane.messages import Payload, StageInput, StageOutput
from omni_mesh.sidecar.engine_link.work import EngineRun, Work

pytestmark = pytest.mark.unit


class FakeClient:
    def __init__(self, submit_delay: float = 0.0) -> None:
        self.submitted: list[str] = []
        self.left: list[str] = []
        self.works: dict[str, Work] = {}
        self.delay = submit_delay
        self.changed = asyncio.Event()

    async def submit(self, si: StageInput) -> tuple[str, Work]:
        await asyncio.sleep(self.delay)
        self.submitted.append(si.request_id)
        work = self.works[si.request_id] = Work(whole=True)
        self.changed.set()
        return si.request_id, work

    def leave(self, key: str, work: Work) -> None:
        self.left.append(key)


async def _submitted(client: FakeClient, rid: str) -> Work:
    """The work of ``rid`` once submitted (its reader then waits for outputs)."""
    while rid not in client.works:
        client.changed.clear()
        await client.changed.wait()
    await asyncio.sleep(0)  # the reader is in its mailbox's get() now
    return client.works[rid]


def _si(rid: str) -> StageInput:
    return StageInput(
        pipeline="p", request_id=rid, stage_id=0, deadline_ms=2**40, seed=0, payload=Payload()
    )


def _out(rid: str, chunk: int, last: bool) -> StageOutput:
    return StageOutput(request_id=rid, stage_id=0, chunk=chunk, last=last)


def test_outputs_until_the_last_then_nothing_left_to_abort() -> None:
    async def main() -> None:
        client = FakeClient()
        run = EngineRun(client, _si("a"))
        assert client.submitted == []  # nothing before the first read
        reader = asyncio.create_task(anext(run))
        await _submitted(client, "a")
        client.works["a"].mailbox.put_nowait(_out("a", 0, False))
        assert (await reader).chunk == 0
        client.works["a"].mailbox.put_nowait(_out("a", 1, True))
        assert (await anext(run)).last
        with pytest.raises(StopAsyncIteration):
            await anext(run)
        await run.aclose()
        assert client.left == []

    asyncio.run(main())


def test_leaving_early_aborts_once_whichever_way() -> None:
    async def main() -> None:
        client = FakeClient()
        closed = EngineRun(client, _si("closed"))
        reader = asyncio.create_task(anext(closed))
        await _submitted(client, "closed")
        client.works["closed"].mailbox.put_nowait(_out("closed", 0, False))
        await reader
        await closed.aclose()
        await closed.aclose()
        cancelled = EngineRun(client, _si("cancelled"))
        waiting = asyncio.create_task(anext(cancelled))
        await _submitted(client, "cancelled")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert client.left == ["closed", "cancelled"]

    asyncio.run(main())


def test_closed_while_being_submitted_aborts_after_the_submission() -> None:
    async def main() -> None:
        client = FakeClient(submit_delay=0.05)
        run = EngineRun(client, _si("racing"))
        reader = asyncio.create_task(anext(run))
        await asyncio.sleep(0.01)
        await run.aclose()  # the submission is on its way
        with pytest.raises(StopAsyncIteration):
            await reader
        assert client.submitted == ["racing"] and client.left == ["racing"]

    asyncio.run(main())


def test_an_error_ends_it_and_a_run_dropped_unfinished_is_aborted_in_the_loop() -> None:
    async def main() -> None:
        client = FakeClient()
        failing = EngineRun(client, _si("failing"))
        reader = asyncio.create_task(anext(failing))
        await _submitted(client, "failing")
        client.works["failing"].mailbox.put_nowait(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await reader
        with pytest.raises(StopAsyncIteration):
            await anext(failing)
        dropped = EngineRun(client, _si("dropped"))
        reader = asyncio.create_task(anext(dropped))
        await _submitted(client, "dropped")
        client.works["dropped"].mailbox.put_nowait(_out("dropped", 0, False))
        await reader
        del dropped, reader
        gc.collect()
        assert client.left == []  # scheduled in the loop, not run in the finalizer
        await asyncio.sleep(0)
        assert client.left == ["dropped"]

    asyncio.run(main())
