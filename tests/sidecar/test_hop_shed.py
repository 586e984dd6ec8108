"""The hop client against receivers whose admission queue sheds (503, type ``shed``): not a
replica failure (no ejection, no retry spent), another replica is tried, and when every
replica sheds the hop fails at once with the largest Retry-After. An empty pool is waited on
through the pool-change event, not by polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Iterable

import pytest
from aiohttp import web

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.connectors import HttpConnector
from omni_mesh.data_plane.constants import MSGPACK
from omni_mesh.data_plane.messages import HopResult, Payload, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.hop.budget import HopUnavailable
from omni_mesh.sidecar.hop.client import HopClient
from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.router import Replica, Router
from omni_mesh.sidecar.hop.shed import SHED_TYPE, Shed
from tests.sidecar.hops import send, serve_hops

pytestmark = pytest.mark.unit

STAGE = 1
Env = tuple[HopHttpClient, ShmReader, list["Receiver"]]


class Receiver:
    """A loopback replica that sheds (``retry_after_s`` set) or answers."""

    def __init__(self, name: str, retry_after_s: float | None) -> None:
        self.name = name
        self.retry_after_s = retry_after_s
        self.calls = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> Receiver:
        self.runner, self.port = await serve_hops(self.hop)
        return self

    async def hop(self, request: web.Request) -> web.Response:
        si = codec.decode(await request.read(), StageInput)
        self.calls += 1
        if self.retry_after_s is not None:
            shed = Shed("queue_full", self.retry_after_s, "the queue is full")
            body = {"error": {"message": shed.message(), "type": SHED_TYPE, "param": None}}
            return web.Response(status=503, text=json.dumps(body), content_type="application/json")
        result = HopResult(request_id=si.request_id, outputs={2: Payload(fields={"by": self.name})})
        return web.Response(body=codec.encode(result), content_type=MSGPACK)

    def replica(self) -> Replica:
        return Replica(self.name, STAGE, f"http://127.0.0.1:{self.port}", "host-b", capacity=8)


class Pools:
    def __init__(self, *replicas: Replica) -> None:
        self.members = list(replicas)
        self.changed = asyncio.Event()
        self.waits = 0

    def replicas(self, stage_id: int) -> Iterable[Replica]:
        return list(self.members)

    async def wait_changed(self, timeout_s: float) -> None:
        self.waits += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout_s)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    http, reader, servers = HopHttpClient(), ShmReader(), list[Receiver]()
    yield http, reader, servers
    for s in servers:
        assert s.runner is not None
        await s.runner.cleanup()
    await http.close()
    reader.close()


async def receiver(env: Env, name: str, shed: float | None) -> Receiver:
    r = await Receiver(name, shed).start()
    env[2].append(r)
    return r


def client(env: Env, pools: Pools) -> tuple[HopClient, Router]:
    router = Router(pools, host_id="host-a", rng=random.Random(1))
    connector = HttpConnector()
    hop = HopClient(env[0], router, lambda a, b: connector, env[1], retries=0, pool_changes=pools)
    return hop, router


def hop_input(deadline_s: float = 10.0) -> StageInput:
    return StageInput(
        pipeline="synthetic",
        request_id="r-1",
        stage_id=STAGE,
        from_stage=0,
        deadline_ms=int((time.time() + deadline_s) * 1000),
        seed=1,
        payload=Payload(fields={"prompt": "p"}),
    )


async def test_a_shedding_replica_is_skipped_not_ejected(env: Env) -> None:
    full = await receiver(env, "full", 2.0)
    ok = await receiver(env, "ok", None)
    pools = Pools(full.replica(), ok.replica())
    hop, router = client(env, pools)
    for _ in range(4):  # P2C picks either first: every hop ends on "ok"
        result = await send(hop, hop_input())
        assert result.error is None and result.outputs[2].fields == {"by": "ok"}
    assert full.calls >= 1  # it was tried, and shed …
    names = {r.instance_id for r in router.candidates(STAGE, set())}
    assert names == {"full", "ok"}  # … but not ejected, and retries=0 was not spent


async def test_when_every_replica_sheds_the_hop_fails_at_once(env: Env) -> None:
    a, b = await receiver(env, "a", 1.5), await receiver(env, "b", 4.2)
    hop, _ = client(env, Pools(a.replica(), b.replica()))
    t0 = time.monotonic()
    with pytest.raises(HopUnavailable) as info:
        await send(hop, hop_input(deadline_s=30.0))
    assert time.monotonic() - t0 < 2.0  # no waiting for the deadline
    assert info.value.code == "shed" and info.value.retry_after_s == pytest.approx(4.2)
    assert (a.calls, b.calls) == (1, 1)  # one look at each, no polling


async def test_an_empty_pool_waits_for_a_change_not_a_timer(env: Env) -> None:
    ok = await receiver(env, "ok", None)
    pools = Pools()
    hop, _ = client(env, pools)

    async def arrives() -> None:
        await asyncio.sleep(0.3)
        pools.members.append(ok.replica())
        pools.changed.set()

    task = asyncio.create_task(arrives())
    result = await send(hop, hop_input())
    await task
    assert result.outputs[2].fields == {"by": "ok"}
    assert pools.waits == 1  # woken by the change: one wait, no polling loop
