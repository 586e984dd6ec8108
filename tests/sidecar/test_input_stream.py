"""Streamed inputs between sidecars (``sidecar/hop/input_stream.py``): the chunks a runner holds
reach the replica that pulls them in order as they come, through the real ``POST /v1/hop/input``
route on a loopback aiohttp server (the pod behind it reduced to what the route reads: its hop
token and its held streams); a stream dropped before its last chunk, one not held, a bad token
and a bad body each fail the pull with the reason. Also the spec rule (one source) and the
growing input an engine sees (``engines/fed.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web

from omni_mesh.configs.pipeline_spec import PipelineSpec, StageSpec
from omni_mesh.data_plane.messages import Payload, StageInput
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import EngineInputError, StageData
from omni_mesh.engines.fed import FedInput
from omni_mesh.sidecar.api import input_route
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.hop.client import HOP_TOKEN_HEADER
from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.input_stream import InputPullError, InputStreams, pull_input
from omni_mesh.sidecar.middleware import error_middleware

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "secret-token"


def chunk(index: int, last: bool = False, request_id: str = "r1") -> StageInput:
    rows = np.full((2, 3), index, np.float32)
    return StageInput(
        pipeline="p",
        request_id=request_id,
        stage_id=1,
        from_stage=0,
        chunk=index,
        last=last,
        deadline_ms=int((time.time() + 60) * 1000),
        seed=1,
        payload=Payload(tensors={"rows": tensor_from_array(rows)}),
    )


class Sender:
    def __init__(self) -> None:
        self.streams = InputStreams()
        self.url = ""
        pod = SimpleNamespace(runner=object(), hop_token=TOKEN, input_streams=self.streams)
        self.app = web.Application(middlewares=[error_middleware])
        self.app[POD] = pod  # type: ignore[assignment]
        input_route.add_routes(self.app)


@pytest.fixture
async def sender() -> AsyncIterator[Sender]:
    s = Sender()
    runner = web.AppRunner(s.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s.url = f"http://127.0.0.1:{port}"
    try:
        yield s
    finally:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[HopHttpClient]:
    client = HopHttpClient()
    try:
        yield client
    finally:
        await client.close()


async def pulled(http: HopHttpClient, url: str, token: str = TOKEN) -> list[int]:
    got = []
    async for si in pull_input(http, url, {HOP_TOKEN_HEADER: token}, chunk(0), 10.0):
        got.append(int(array_from_tensor(si.payload.tensors["rows"])[0, 0]))
    return got


async def test_chunks_come_in_order_as_the_runner_puts_them(
    sender: Sender, http: HopHttpClient
) -> None:
    held = sender.streams.open("r1", 1)
    held.put(chunk(1))

    async def later() -> None:
        for i in range(2, 6):
            await asyncio.sleep(0.02)
            held.put(chunk(i, last=i == 5))

    task = asyncio.create_task(later())
    assert await pulled(http, sender.url) == [1, 2, 3, 4, 5]
    await task
    # a second pull (a replay on another replica) gets them all again
    assert await pulled(http, sender.url) == [1, 2, 3, 4, 5]
    sender.streams.close("r1", 1, held)
    assert len(sender.streams) == 0


async def test_a_stream_dropped_before_its_last_chunk_fails_the_pull(
    sender: Sender, http: HopHttpClient
) -> None:
    held = sender.streams.open("r1", 1)
    held.put(chunk(1))
    asyncio.get_running_loop().call_later(0.05, sender.streams.close, "r1", 1, held)
    with pytest.raises(InputPullError, match="streamed input from"):
        await pulled(http, sender.url)


async def test_a_stream_not_held_or_a_bad_token_fails_the_pull_with_the_reason(
    sender: Sender, http: HopHttpClient
) -> None:
    with pytest.raises(InputPullError, match=r"HTTP 404.*no streamed input of request 'r1'"):
        await pulled(http, sender.url)
    sender.streams.open("r1", 1)
    with pytest.raises(InputPullError, match="HTTP 401"):
        await pulled(http, sender.url, token="wrong")


def test_a_stage_with_stream_input_needs_exactly_one_source() -> None:
    stages = [
        StageSpec(stage_id=0, name="a", engine="m:A"),
        StageSpec(stage_id=1, name="b", engine="m:B", sources=(0,)),
        StageSpec(
            stage_id=2,
            name="c",
            engine="m:C",
            sources=(0, 1),
            stream_input=True,
            final_output="text",
        ),
    ]
    with pytest.raises(
        ValueError, match="stage 2 \\(c\\) has stream_input, which needs exactly one"
    ):
        PipelineSpec(name="p", stages=tuple(stages))


def test_a_growing_input_joins_its_chunks_and_names_a_chunk_that_does_not_fit() -> None:
    data = StageData(fields={"a": 1}, arrays={"x": np.arange(4, dtype=np.int64)})
    fed = FedInput(data)
    seen = data.arrays
    for i in range(1, 40):
        fed.append(StageData(fields={"b": i}, arrays={"x": np.array([100 + i], np.int64)}))
    assert data.arrays is seen  # updated in place: the engine's request sees it
    assert np.array_equal(data.arrays["x"], np.r_[np.arange(4), 101:140])
    assert data.fields == {"a": 1, "b": 39}
    fed.append(StageData(arrays={"x": np.zeros(0, np.int64)}))  # no rows: nothing changes
    assert data.arrays["x"].shape == (43,)
    with pytest.raises(EngineInputError, match="chunk 41: array 'x' is float32"):
        fed.append(StageData(arrays={"x": np.zeros(2, np.float32)}))
