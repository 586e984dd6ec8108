"""The ``/v1/run`` client across a join (0 -> (1, 2) -> 3), against a real aiohttp server
faking the stages' far side: the join is called once, with both branches' inputs in the
pipeline's source order whichever branch answers first, in JSON and msgpack; a branch that gives
two inputs for the join, or none, fails the run with a clear message."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec, StageSpec
from omni_mesh.data_plane.messages import (
    NextInput,
    NextInputBin,
    Prompt,
    RunOutput,
    RunOutputBin,
    RunRequest,
    RunRequestBin,
    RunResponse,
    RunResponseBin,
)
from omni_mesh.procutil import free_port
from omni_mesh.run_client.client import FixedUrls, RunClient, RunClientError

pytestmark = pytest.mark.timeout(60)

MSGPACK = "application/msgpack"
DIAMOND = PipelineSpec(
    name="diamond-test",
    stages=(
        StageSpec(stage_id=0, name="root", engine="x:Y"),
        StageSpec(stage_id=1, name="left", engine="x:Y", sources=(0,)),
        StageSpec(stage_id=2, name="right", engine="x:Y", sources=(0,)),
        StageSpec(
            stage_id=3, name="join", engine="x:Y", sources=(1, 2), final_output=OutputKind.TEXT
        ),
    ),
)


@dataclass
class FakeDiamond:
    """Opaque inputs are ``s<k>:<from>``; the join answers the inputs it got, in order.
    ``slow``: the branch that answers late; ``extra``: the branch that gives the join twice;
    ``mute``: the branch that gives the join nothing."""

    slow: int = 1
    extra: int | None = None
    mute: int | None = None
    calls: list[int] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        binary = request.content_type == MSGPACK
        body = await request.read()
        req: RunRequest | RunRequestBin = (
            msgspec.msgpack.decode(body, type=RunRequestBin)
            if binary
            else msgspec.json.decode(body, type=RunRequest)
        )
        self.calls.append(req.stage_id)
        k = req.stage_id
        if k == 0:
            assert isinstance(req.stage_input, Prompt)
            return _answer(binary, 0, [(1, b"s1:0"), (2, b"s2:0")])
        if k in (1, 2):
            assert _raw(req.stage_input, binary) == f"s{k}:0".encode()
            if k == self.slow:
                await asyncio.sleep(0.1)
            nexts = [] if k == self.mute else [(3, f"s3:{k}".encode())]
            return _answer(binary, k, nexts * (2 if k == self.extra else 1))
        assert req.stage_input is None and req.stage_inputs is not None
        got = [_raw(v, binary).decode() for v in req.stage_inputs]
        return _answer(binary, 3, [], RunOutputBin("text", text=" ".join(got)))


def _raw(value: object, binary: bool) -> bytes:
    if binary:
        assert isinstance(value, bytes)
        return value
    assert isinstance(value, str)
    return base64.b64decode(value)


def _answer(
    binary: bool, stage_id: int, nexts: list[tuple[int, bytes]], out: RunOutputBin | None = None
) -> web.Response:
    if binary:
        rb = RunResponseBin(stage_id=stage_id, request_id="req-1", output=out)
        if nexts:
            rb.next = [NextInputBin(k, v) for k, v in nexts]
        return web.Response(body=msgspec.msgpack.encode(rb), content_type=MSGPACK)
    rj = RunResponse(stage_id=stage_id, request_id="req-1")
    if out is not None:
        rj.output = RunOutput(out.kind, text=out.text)
    if nexts:
        rj.next = [NextInput(k, base64.b64encode(v).decode()) for k, v in nexts]
    return web.Response(body=msgspec.json.encode(rj), content_type="application/json")


Serve = Callable[[FakeDiamond], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[TestServer] = []

    async def start(fake: FakeDiamond) -> str:
        app = web.Application()
        app.router.add_post("/v1/run", fake.handle)
        server = TestServer(app, host="127.0.0.1", port=free_port())
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("slow", [1, 2], ids=["left-slow", "right-slow"])
async def test_join_is_called_once_with_inputs_in_source_order(
    serve: Serve, binary: bool, slow: int
) -> None:
    fake = FakeDiamond(slow=slow)
    async with RunClient(DIAMOND, FixedUrls([await serve(fake)]), msgpack=binary) as client:
        trace = await client.run(Prompt(prompt="p"))
    assert sorted(fake.calls) == [0, 1, 2, 3]
    assert trace.outputs[3].text == "s3:1 s3:2"
    join_call = next(c for c in trace.calls if c.stage_id == 3)
    assert join_call.index == 4  # after both branches


@pytest.mark.parametrize(
    ("fake", "message"),
    [
        (FakeDiamond(extra=2), "stage 2 gave more than one input for join stage 3"),
        (
            FakeDiamond(mute=1),
            r"stage 3 is a join of stages [1, 2] but only stage(s) [2] gave an input for it",
        ),
    ],
    ids=["twice", "missing"],
)
async def test_a_branch_that_does_not_give_one_input_fails_the_run(
    serve: Serve, fake: FakeDiamond, message: str
) -> None:
    async with RunClient(DIAMOND, FixedUrls([await serve(fake)])) as client:
        with pytest.raises(RunClientError) as err:
            await client.run(Prompt(prompt="p"))
    assert message in str(err.value)
    assert 3 not in fake.calls
