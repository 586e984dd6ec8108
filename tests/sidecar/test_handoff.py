"""HopClient against real loopback HTTP servers standing in for replicas of the next stage.

Each fake replica is an aiohttp server answering ``POST /v1/hop`` the way a test tells it to
(200 with a msgpack HopResult, 5xx, 429, 409, 400), plus a raw server that drops connections and
a port nobody listens on. The router reads a fake pool that the test changes as discovery would.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator

import numpy as np
import pytest
from aiohttp import web

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.connectors import Connector, HttpConnector, SharedMemoryConnector
from omni_mesh.data_plane.constants import MSGPACK
from omni_mesh.data_plane.messages import (
    HopResult,
    Payload,
    StageInput,
    StageTiming,
    Tensor,
)
from omni_mesh.data_plane.shm import ShmArena, ShmReader
from omni_mesh.data_plane.tensors import array_from_tensor
from omni_mesh.sidecar.hop.budget import HopStats, HopUnavailable
from omni_mesh.sidecar.hop.client import HopClient
from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.router import Replica, Router
from tests.sidecar.hops import send, serve_hops

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

HOST = "host-a"
STAGE = 1


# ---- fake replicas ---------------------------------------------------------------------------


class FakeReplica:
    """An aiohttp server for ``POST /v1/hop`` whose answers follow ``script`` (one status per
    call, the last one repeating); it records every StageInput it receives."""

    def __init__(self, name: str, script: Iterable[int] = (200,)) -> None:
        self.name = name
        self.script = list(script)
        self.received: list[StageInput] = []
        self.headers: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> FakeReplica:
        self.runner, self.port = await serve_hops(self.hop)
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def hop(self, request: web.Request) -> web.StreamResponse:
        si = codec.decode(await request.read(), StageInput)
        self.received.append(si)
        self.headers.append(dict(request.headers))
        status = self.script[min(len(self.received), len(self.script)) - 1]
        if status != 200:
            return web.Response(status=status, text=f"{self.name} says {status}")
        result = HopResult(
            request_id=si.request_id,
            outputs={STAGE + 1: Payload(fields={"served_by": self.name})},
            timings=[StageTiming(STAGE, self.name, engine_ms=1.0, queue_ms=0.0, total_ms=2.0)],
        )
        return web.Response(body=codec.encode(result), content_type=MSGPACK)

    def replica(self, *, host: str = "host-b", reported: int = 0) -> Replica:
        return make_replica(self.name, f"http://127.0.0.1:{self.port}", host, reported)


class DroppingServer:
    """Accepts a connection, reads the request head and closes without answering."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections = 0

    async def start(self) -> DroppingServer:
        self.server = await asyncio.start_server(self._drop, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _drop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.close()
        await writer.wait_closed()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def replica(self) -> Replica:
        return make_replica(self.name, f"http://127.0.0.1:{self.port}", "host-b", 0)


def make_replica(name: str, address: str, host: str, reported: int) -> Replica:
    return Replica(
        instance_id=name,
        stage_id=STAGE,
        address=address,
        host_id=host,
        capacity=8,
        reported_in_flight=reported,
    )


def refused_replica(name: str = "refused") -> Replica:
    """A replica on a loopback port that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return make_replica(name, f"http://127.0.0.1:{port}", "host-b", 0)


class FakePools:
    def __init__(self, *replicas: Replica) -> None:
        self.members: list[Replica] = list(replicas)

    def replicas(self, stage_id: int) -> Iterable[Replica]:
        return [r for r in self.members if r.stage_id == stage_id]


# ---- fixtures --------------------------------------------------------------------------------

StartReplica = Callable[..., Awaitable[FakeReplica]]


@pytest.fixture
async def start_replica() -> AsyncIterator[StartReplica]:
    servers: list[FakeReplica] = []

    async def start(name: str, script: Iterable[int] = (200,)) -> FakeReplica:
        server = await FakeReplica(name, script).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def dropping_server() -> AsyncIterator[DroppingServer]:
    server = await DroppingServer("dropper").start()
    yield server
    await server.stop()


@pytest.fixture
async def session() -> AsyncIterator[HopHttpClient]:
    # Live loopback replicas (refused ports fail at once whatever the timeout): a loaded CI
    # machine can stall this loop past the 0.3 s default and eject the only replica.
    http = HopHttpClient(connect_timeout_s=5.0)
    yield http
    await http.close()


@pytest.fixture
def reader() -> Iterator[ShmReader]:
    with ShmReader() as r:
        yield r


class Hops:
    """A HopClient over a fake pool, with the stats of every hop it sent."""

    def __init__(
        self,
        session: HopHttpClient,
        reader: ShmReader,
        *replicas: Replica,
        retries: int = 2,
        connector: Connector | None = None,
        auth_header: dict[str, str] | None = None,
    ) -> None:
        self.pools = FakePools(*replicas)
        self.router = Router(self.pools, host_id=HOST, eject_s=30.0, rng=random.Random(5))
        self.stats: list[HopStats] = []
        self.connector = connector or HttpConnector()
        self.client = HopClient(
            session,
            self.router,
            lambda from_stage, to_stage: self.connector,
            reader,
            retries=retries,
            auth_header=auth_header,
            on_hop=lambda si, stats: self.stats.append(stats),
        )

    def candidates(self) -> set[str]:
        return {r.instance_id for r in self.router.candidates(STAGE, set())}


MakeHops = Callable[..., Hops]


@pytest.fixture
def make_hops(session: HopHttpClient, reader: ShmReader) -> MakeHops:
    def make(*replicas: Replica, **kwargs: object) -> Hops:
        return Hops(session, reader, *replicas, **kwargs)  # type: ignore[arg-type]

    return make


def hop_input(
    request_id: str = "req-1", *, deadline_s: float = 10.0, payload: Payload | None = None
) -> StageInput:
    return StageInput(
        pipeline="synthetic",
        request_id=request_id,
        stage_id=STAGE,
        from_stage=STAGE - 1,
        deadline_ms=int((time.time() + deadline_s) * 1000),
        seed=99,
        payload=payload or Payload(fields={"prompt": "p"}),
    )


# ---- success ---------------------------------------------------------------------------------


async def test_a_hop_delivers_the_input_and_returns_the_result(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    ok = await start_replica("ok")
    hops = make_hops(ok.replica(), auth_header={"Authorization": "Bearer t0ken"})
    si = hop_input("deliver-1")
    result = await send(hops.client, si)
    assert result.error is None and result.request_id == "deliver-1"
    assert result.outputs[STAGE + 1].fields == {"served_by": "ok"}
    assert [t.instance_id for t in result.timings] == ["ok"]
    (got,) = ok.received
    assert got == si
    assert ok.headers[0]["Content-Type"] == MSGPACK
    assert ok.headers[0]["Authorization"] == "Bearer t0ken"
    (stats,) = hops.stats
    assert (stats.attempts, stats.retries, stats.replica, stats.tried) == (1, 0, "ok", ["ok"])
    assert stats.bytes_sent > 0 and stats.seconds > 0
    assert hops.router.in_flight("ok") == 0


async def test_shared_memory_tensors_are_streamed_inline_over_http(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    ok = await start_replica("ok")
    hops = make_hops(ok.replica())
    arr = np.arange(100_000, dtype=np.float32)
    with ShmArena() as arena:
        slot = arena.alloc(arr.nbytes, "tensor-1")
        slot.view[:] = arr.tobytes()
        tensor = Tensor(dtype="float32", shape=(100_000,), shm=slot.ref)
        si = hop_input("tensor-1", payload=Payload(tensors={"hidden": tensor}))
        result = await send(hops.client, si)
    assert result.error is None
    sent = ok.received[0].payload.tensors["hidden"]
    assert sent.shm is None and sent.data is not None  # the bytes, not a handle
    np.testing.assert_array_equal(array_from_tensor(sent), arr)
    assert hops.stats[0].bytes_sent > arr.nbytes


# ---- replay on failure -----------------------------------------------------------------------


async def _failing_replica(
    kind: str, start_replica: StartReplica, dropping_server: DroppingServer
) -> Replica:
    if kind == "refused":
        return refused_replica("bad")
    if kind == "closed":
        return make_replica("bad", f"http://127.0.0.1:{dropping_server.port}", "host-b", 0)
    server = await start_replica("bad", [int(kind)])
    return server.replica()


@pytest.mark.parametrize("kind", ["503", "502", "504", "refused", "closed"])
async def test_a_failed_replica_is_ejected_and_the_hop_replayed(
    kind: str,
    start_replica: StartReplica,
    dropping_server: DroppingServer,
    make_hops: MakeHops,
) -> None:
    bad = await _failing_replica(kind, start_replica, dropping_server)
    good = await start_replica("good")
    # The good replica reports load, so that P2C tries the failing one first.
    hops = make_hops(bad, good.replica(reported=4), retries=2)
    result = await send(hops.client, hop_input("replay-1"))
    assert result.error is None
    assert result.outputs[STAGE + 1].fields == {"served_by": "good"}
    (replayed,) = good.received
    assert (replayed.request_id, replayed.attempt) == ("replay-1", 1)
    assert (replayed.from_stage, replayed.stage_id, replayed.chunk) == (0, STAGE, 0)
    assert hops.candidates() == {"good"}  # ejected at once
    (stats,) = hops.stats
    assert (stats.attempts, stats.retries, stats.tried) == (2, 1, ["bad", "good"])
    if kind == "closed":
        assert dropping_server.connections >= 1


async def test_the_retry_budget_is_enforced(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    servers = [await start_replica(f"s{i}", [503]) for i in range(4)]
    hops = make_hops(*(s.replica() for s in servers), retries=2)
    with pytest.raises(HopUnavailable, match=r"retry budget \(2\) spent") as info:
        await send(hops.client, hop_input("budget-1"))
    assert info.value.stage_id == STAGE
    received = [si for s in servers for si in s.received]
    assert sorted(si.attempt for si in received) == [0, 1, 2]  # 1 try + 2 replays
    assert {si.request_id for si in received} == {"budget-1"}
    assert sum(1 for s in servers if not s.received) == 1
    assert hops.stats[0].attempts == 3


async def test_stats_count_the_replays_actually_made(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    servers = [await start_replica(f"s{i}", [503]) for i in range(3)]
    hops = make_hops(*(s.replica() for s in servers), retries=1)
    with pytest.raises(HopUnavailable):
        await send(hops.client, hop_input("count-1"))
    (stats,) = hops.stats
    assert stats.attempts == 2
    assert stats.retries == 1  # one replay (attempt 1) after the first failure


async def test_no_retry_budget_means_one_attempt(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    bad, good = await start_replica("bad", [503]), await start_replica("good")
    hops = make_hops(bad.replica(), good.replica(reported=4), retries=0)
    with pytest.raises(HopUnavailable):
        await send(hops.client, hop_input())
    assert len(bad.received) == 1 and good.received == []


# ---- full replicas ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 409])
async def test_a_full_replica_moves_on_without_spending_the_budget(
    status: int, start_replica: StartReplica, make_hops: MakeHops
) -> None:
    full, good = await start_replica("full", [status]), await start_replica("good")
    hops = make_hops(full.replica(), good.replica(reported=4), retries=0)
    result = await send(hops.client, hop_input("full-1"))
    assert result.outputs[STAGE + 1].fields == {"served_by": "good"}
    assert [si.attempt for si in full.received] == [0]
    assert [si.attempt for si in good.received] == [0]  # not a replay: same attempt
    assert hops.candidates() == {"full", "good"}  # not ejected
    assert (hops.stats[0].retries, hops.stats[0].attempts) == (0, 2)


async def test_when_every_replica_is_full_the_hop_waits_for_one(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    busy = await start_replica("busy", [429, 429, 429, 200])
    hops = make_hops(busy.replica(), retries=0)
    result = await send(hops.client, hop_input("wait-1", deadline_s=5.0))
    assert result.outputs[STAGE + 1].fields == {"served_by": "busy"}
    assert [si.attempt for si in busy.received] == [0, 0, 0, 0]
    assert hops.stats[0].waited_full >= 3


async def test_full_until_the_deadline_is_unavailable_in_bounded_time(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    busy = await start_replica("busy", [429])
    hops = make_hops(busy.replica(), retries=5)
    started = time.monotonic()
    with pytest.raises(HopUnavailable, match="deadline") as info:
        await send(hops.client, hop_input(deadline_s=0.5))
    assert info.value.code == "unavailable"  # → 503 + Retry-After: the pool was full
    assert 0.4 < time.monotonic() - started < 1.5
    assert len(busy.received) >= 2
    assert {si.attempt for si in busy.received} == {0}


# ---- bad input -------------------------------------------------------------------------------


async def test_a_400_is_returned_as_bad_input_without_retry(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    picky, good = await start_replica("picky", [400]), await start_replica("good")
    hops = make_hops(picky.replica(), good.replica(reported=4), retries=3)
    result = await send(hops.client, hop_input("bad-1"))
    assert result.request_id == "bad-1"
    assert result.error is not None
    assert (result.error.code, result.error.stage_id) == ("bad_input", STAGE)
    assert "picky says 400" in result.error.message
    assert result.outputs == {}
    assert len(picky.received) == 1 and good.received == []
    assert hops.candidates() == {"picky", "good"}  # its answer was an answer: not ejected


# ---- empty pool ------------------------------------------------------------------------------


async def test_an_empty_pool_waits_until_the_deadline(make_hops: MakeHops) -> None:
    hops = make_hops()
    started = time.monotonic()
    with pytest.raises(HopUnavailable, match="pool empty") as info:
        await send(hops.client, hop_input(deadline_s=0.5))
    assert 0.4 < time.monotonic() - started < 1.5
    assert info.value.stage_id == STAGE
    assert hops.stats[0].attempts == 0 and hops.stats[0].waited_full > 1


async def test_a_past_deadline_fails_at_once_without_sending(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    ok = await start_replica("ok")
    hops = make_hops(ok.replica())
    started = time.monotonic()
    with pytest.raises(HopUnavailable) as info:
        await send(hops.client, hop_input(deadline_s=-1.0))
    assert time.monotonic() - started < 0.2
    assert ok.received == []
    assert info.value.code == "deadline"  # → 504: nothing was tried, no replica is to blame


async def test_a_replica_that_appears_while_waiting_gets_the_hop(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    late = await start_replica("late")
    hops = make_hops()

    async def discover_later() -> None:
        await asyncio.sleep(0.3)
        hops.pools.members.append(late.replica())

    joiner = asyncio.create_task(discover_later())
    started = time.monotonic()
    result = await send(hops.client, hop_input("late-1", deadline_s=10.0))
    await joiner
    assert result.outputs[STAGE + 1].fields == {"served_by": "late"}
    assert 0.25 < time.monotonic() - started < 2.0
    assert [si.attempt for si in late.received] == [0]


async def test_every_replica_ejected_waits_for_discovery_of_a_new_one(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    bad, fresh = await start_replica("bad", [503]), await start_replica("fresh")
    hops = make_hops(bad.replica(), retries=3)

    async def discover_later() -> None:
        await asyncio.sleep(0.3)
        hops.pools.members.append(fresh.replica())

    joiner = asyncio.create_task(discover_later())
    result = await send(hops.client, hop_input("eject-1", deadline_s=10.0))
    await joiner
    assert result.outputs[STAGE + 1].fields == {"served_by": "fresh"}
    assert [si.attempt for si in fresh.received] == [1]


# ---- same-host preference --------------------------------------------------------------------


async def test_a_shm_edge_prefers_a_replica_on_the_same_host(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    local, remote = await start_replica("local"), await start_replica("remote")
    hops = make_hops(
        local.replica(host=HOST, reported=4), remote.replica(), connector=SharedMemoryConnector()
    )
    for i in range(3):
        await send(hops.client, hop_input(f"local-{i}"))
    assert len(local.received) == 3 and remote.received == []


async def test_an_http_edge_does_not_prefer_the_same_host(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    local, remote = await start_replica("local"), await start_replica("remote")
    hops = make_hops(local.replica(host=HOST, reported=4), remote.replica())
    for i in range(3):
        await send(hops.client, hop_input(f"http-{i}"))
    assert local.received == [] and len(remote.received) == 3


async def test_a_500_is_a_request_failure_not_replayed(
    start_replica: StartReplica, make_hops: MakeHops
) -> None:
    """A 500 says the request broke something (a bug), not that the replica is gone:
    replaying it would only spread it, and ejecting the replica would punish it."""
    bad = await start_replica("bad", [500, 500, 500])
    hops = make_hops(bad.replica(), retries=2)
    result = await send(hops.client, hop_input("no-replay"))
    assert result.error is not None and result.error.code == "engine_error"
    assert "bad says 500" in result.error.message
    assert len(bad.received) == 1  # not replayed
    assert hops.candidates() == {"bad"}  # not ejected
