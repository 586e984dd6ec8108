"""Streamed hop answers (async_chunk): the frame reader and the replay of broken streams.

Fake replicas are loopback aiohttp servers that answer ``POST /v1/hop`` with a chunked stream
of length-prefixed HopResult frames, as a stage sidecar does when its engine emits chunks. A
test scripts how far each replica gets before it drops the connection.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web

from omni_mesh.data_plane import codec, framing, wire
from omni_mesh.data_plane.connectors import HttpConnector
from omni_mesh.data_plane.constants import HOP_FRAMES
from omni_mesh.data_plane.messages import HopResult, Payload, StageInput, StageTiming
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.hop.budget import HopStats, HopUnavailable
from omni_mesh.sidecar.hop.client import HOP_PATH, HopClient
from omni_mesh.sidecar.hop.http import HopConnectionError, HopHttpClient
from omni_mesh.sidecar.hop.router import Router
from tests.sidecar.test_handoff import STAGE, FakePools, FakeReplica, hop_input

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

OUT_STAGE = STAGE + 1


def frame_bytes(frame: HopResult) -> bytes:
    body = codec.encode(frame)
    return framing.HEADER.pack(len(body)) + body


def chunk_frame(si: StageInput, chunk: int, who: str) -> HopResult:
    payload = Payload(fields={"chunk": chunk, "served_by": who})
    return HopResult(
        request_id=si.request_id, outputs={OUT_STAGE: payload}, chunks={OUT_STAGE: chunk}, more=True
    )


class StreamingReplica(FakeReplica):
    """Streams ``chunks`` frames for every hop, then a last frame with a timing — unless
    ``drop_after`` says to drop the connection after that many frames (``None``: never) or
    ``no_last`` to end the body cleanly without the last frame. ``gate``, when set, holds
    each frame after the first until the test releases it. (Server lifecycle and
    ``replica()`` as :class:`FakeReplica`'s.)"""

    def __init__(
        self,
        name: str,
        chunks: int,
        *,
        drop_after: int | None = None,
        no_last: bool = False,
        gate: asyncio.Event | None = None,
    ) -> None:
        super().__init__(name)
        self.chunks = chunks
        self.drop_after = drop_after
        self.no_last = no_last
        self.gate = gate

    async def hop(self, request: web.Request) -> web.StreamResponse:
        si = codec.decode(await request.read(), StageInput)
        self.received.append(si)
        resp = web.StreamResponse(headers={"Content-Type": HOP_FRAMES})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for chunk in range(self.chunks):
            if self.drop_after is not None and chunk == self.drop_after:
                assert request.transport is not None
                request.transport.abort()  # the replica "dies" mid-stream
                return resp
            if chunk and self.gate is not None:
                await self.gate.wait()
            await resp.write(frame_bytes(chunk_frame(si, chunk, self.name)))
        if not self.no_last:
            timing = StageTiming(STAGE, self.name, engine_ms=1.0, queue_ms=0.0, total_ms=1.0)
            await resp.write(frame_bytes(HopResult(request_id=si.request_id, timings=[timing])))
        await resp.write_eof()
        return resp


@pytest.fixture
async def replicas() -> AsyncIterator[list[StreamingReplica]]:
    started: list[StreamingReplica] = []
    yield started
    for server in started:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[HopHttpClient]:
    client = HopHttpClient()
    yield client
    await client.close()


@pytest.fixture
def reader() -> Iterator[ShmReader]:
    with ShmReader() as r:
        yield r


async def start(replicas: list[StreamingReplica], *servers: StreamingReplica) -> None:
    for server in servers:
        await server.start()
        replicas.append(server)


def hop_client(
    http: HopHttpClient, reader: ShmReader, servers: list[StreamingReplica], retries: int = 2
) -> tuple[HopClient, Router, list[HopStats]]:
    pools = FakePools(*(s.replica() for s in servers))
    router = Router(pools, host_id="host-a", eject_s=30.0, rng=random.Random(3))
    stats: list[HopStats] = []
    client = HopClient(
        http,
        router,
        lambda a, b: HttpConnector(),
        reader,
        retries=retries,
        on_hop=lambda si, s: stats.append(s),
    )
    return client, router, stats


def chunks_of(frames: list[HopResult]) -> list[tuple[int, str]]:
    """(chunk, served_by) of every output, in the order they were passed on."""
    return [
        (f.chunks.get(OUT_STAGE, 0), str(f.outputs[OUT_STAGE].fields["served_by"]))
        for f in frames
        if OUT_STAGE in f.outputs
    ]


# ---- the frame reader ------------------------------------------------------------------------


async def test_frames_arrive_one_by_one_and_the_connection_is_reused(
    replicas: list[StreamingReplica], http: HopHttpClient
) -> None:
    gate = asyncio.Event()
    server = StreamingReplica("a", 3, gate=gate)
    await start(replicas, server)
    address = f"http://127.0.0.1:{server.port}"
    body = codec.encode(hop_input())
    resp = await http.post(
        address, HOP_PATH, body, {}, timeout_s=10, max_bytes=1 << 20, stream_type=HOP_FRAMES
    )
    assert resp.status == 200 and resp.frames is not None
    async with resp.frames as frames:
        first = codec.decode(await anext(frames), HopResult)
        assert first.chunks == {OUT_STAGE: 0} and first.more  # before the server sent more
        gate.set()
        rest = [codec.decode(raw, HopResult) async for raw in frames]
    assert [f.chunks.get(OUT_STAGE) for f in rest] == [1, 2, None]
    assert not rest[-1].more
    # The body ended cleanly: the next call goes over the same kept-alive connection.
    again = await http.post(
        address, HOP_PATH, body, {}, timeout_s=10, max_bytes=1 << 20, stream_type=HOP_FRAMES
    )
    assert again.frames is not None
    async with again.frames as frames:
        assert len([raw async for raw in frames]) == 4
    assert sum(len(c) for c in http._idle.values()) == 1


async def test_a_stream_that_drops_is_a_connection_error(
    replicas: list[StreamingReplica], http: HopHttpClient
) -> None:
    server = StreamingReplica("a", 4, drop_after=2)
    await start(replicas, server)
    resp = await http.post(
        f"http://127.0.0.1:{server.port}",
        HOP_PATH,
        codec.encode(hop_input()),
        {},
        timeout_s=10,
        max_bytes=1 << 20,
        stream_type=HOP_FRAMES,
    )
    assert resp.frames is not None
    got: list[bytes] = []
    with pytest.raises(HopConnectionError, match="broke off"):
        async with resp.frames as frames:
            async for raw in frames:
                got.append(raw)
    assert len(got) == 2
    assert not http._idle.get(("127.0.0.1", server.port))  # a broken connection is not kept


async def test_an_oversized_frame_is_refused_before_it_is_read(
    replicas: list[StreamingReplica], http: HopHttpClient
) -> None:
    server = StreamingReplica("a", 2)
    await start(replicas, server)
    resp = await http.post(
        f"http://127.0.0.1:{server.port}",
        HOP_PATH,
        codec.encode(hop_input()),
        {},
        timeout_s=10,
        max_bytes=16,
        stream_type=HOP_FRAMES,
    )
    assert resp.frames is not None
    with pytest.raises(wire.ResponseTooLarge):
        async with resp.frames as frames:
            await anext(frames)


# ---- replay of broken streams ----------------------------------------------------------------


async def test_a_stream_broken_mid_way_is_replayed_and_no_chunk_is_passed_on_twice(
    replicas: list[StreamingReplica], http: HopHttpClient, reader: ShmReader
) -> None:
    dying = StreamingReplica("dying", 5, drop_after=2)
    healthy = StreamingReplica("healthy", 5)
    await start(replicas, dying, healthy)
    client, router, stats = hop_client(http, reader, [dying, healthy])
    # Make the dying replica the first choice: the healthy one looks busier.
    router.begin("healthy")
    router.begin("healthy")
    frames = [f async for f in client.stream(hop_input())]
    router.end("healthy")
    router.end("healthy")
    assert chunks_of(frames) == [
        (0, "dying"),
        (1, "dying"),
        (2, "healthy"),
        (3, "healthy"),
        (4, "healthy"),
    ]
    assert [f.more for f in frames] == [True] * 5 + [False]
    assert frames[-1].timings[0].instance_id == "healthy"
    assert len(healthy.received) == 1 and healthy.received[0].attempt == 1  # a replay
    assert "dying" not in {r.instance_id for r in router.candidates(STAGE, set())}
    assert stats[-1].retries == 1
    assert router.in_flight("healthy") == 0 and router.in_flight("dying") == 0


async def test_a_stream_that_ends_without_its_last_frame_is_replayed(
    replicas: list[StreamingReplica], http: HopHttpClient, reader: ShmReader
) -> None:
    truncated = StreamingReplica("truncated", 3, no_last=True)
    healthy = StreamingReplica("healthy", 3)
    await start(replicas, truncated, healthy)
    client, router, _ = hop_client(http, reader, [truncated, healthy])
    router.begin("healthy")
    frames = [f async for f in client.stream(hop_input())]
    router.end("healthy")
    assert [c for c, _ in chunks_of(frames)] == [0, 1, 2]
    assert {who for _, who in chunks_of(frames)} == {"truncated"}
    assert len(healthy.received) == 1  # the last frame came from the replay
    assert not frames[-1].more


async def test_streams_that_keep_breaking_spend_the_retry_budget(
    replicas: list[StreamingReplica], http: HopHttpClient, reader: ShmReader
) -> None:
    servers = [StreamingReplica(f"r{i}", 4, drop_after=1) for i in range(3)]
    await start(replicas, *servers)
    client, _, _ = hop_client(http, reader, servers, retries=1)
    got: list[HopResult] = []
    with pytest.raises(HopUnavailable, match="broke off"):
        async for frame in client.stream(hop_input()):
            got.append(frame)
    assert [c for c, _ in chunks_of(got)] == [0]  # passed on once, never again
    assert sum(len(s.received) for s in servers) == 2  # the first try and one replay


async def test_leaving_a_stream_early_closes_its_connection(
    replicas: list[StreamingReplica], http: HopHttpClient, reader: ShmReader
) -> None:
    gate = asyncio.Event()
    server = StreamingReplica("slow", 3, gate=gate)
    await start(replicas, server)
    client, router, _ = hop_client(http, reader, [server])
    stream = client.stream(hop_input())
    first = await anext(stream)
    assert first.chunks == {OUT_STAGE: 0}
    assert router.in_flight("slow") == 1  # a stream keeps its replica busy until it ends
    await stream.aclose()
    assert router.in_flight("slow") == 0
    assert not http._idle.get(("127.0.0.1", server.port))
    gate.set()
