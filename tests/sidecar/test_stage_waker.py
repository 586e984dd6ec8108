"""Waking a stage at zero: the hop client tells ``on_empty_pool`` (again and again, with how
many hops wait) while hops wait for a stage whose pool is empty, never while replicas exist
but are busy; :class:`StageWaker` turns that into a wake hint per stage at most every
``every_s``, which a real omni-cp turns into a decision for one replica."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterable

import pytest
from aiohttp import web

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.client import ControlPlaneClient, ScaleStatus
from omni_mesh.data_plane import codec
from omni_mesh.data_plane.connectors import HttpConnector
from omni_mesh.data_plane.constants import MSGPACK
from omni_mesh.data_plane.messages import HopResult, Payload, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.hop.client import HOP_PATH, HopClient
from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.router import Replica, Router
from omni_mesh.sidecar.hop.waker import StageWaker
from tests.procs import start_control_plane
from tests.sidecar.hops import send

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

STAGE = 1


class Pools:
    def __init__(self) -> None:
        self.members: list[Replica] = []

    def replicas(self, stage_id: int) -> Iterable[Replica]:
        return [r for r in self.members if r.stage_id == stage_id]


async def _replica(status: int) -> tuple[web.AppRunner, Replica]:
    async def hop(request: web.Request) -> web.Response:
        si = codec.decode(await request.read(), StageInput)
        if status != 200:
            return web.Response(status=status, text="busy")
        body = codec.encode(HopResult(request_id=si.request_id, outputs={}))
        return web.Response(body=body, content_type=MSGPACK)

    app = web.Application()
    app.router.add_post(HOP_PATH, hop)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    replica = Replica(f"r{port}", STAGE, f"http://127.0.0.1:{port}", "host-b", 8, 0)
    return runner, replica


def _input(request_id: str, deadline_s: float) -> StageInput:
    return StageInput(
        pipeline="synthetic",
        request_id=request_id,
        stage_id=STAGE,
        from_stage=STAGE - 1,
        deadline_ms=int((time.time() + deadline_s) * 1000),
        seed=1,
        payload=Payload(fields={"prompt": "p"}),
    )


@pytest.fixture
async def hops() -> AsyncIterator[tuple[HopClient, Pools, list[tuple[int, int, float]]]]:
    pools = Pools()
    calls: list[tuple[int, int, float]] = []
    http = HopHttpClient()
    with ShmReader() as reader:
        client = HopClient(
            http,
            Router(pools, host_id="host-a", rng=random.Random(1)),
            lambda a, b: HttpConnector(),
            reader,
            retries=2,
            on_empty_pool=lambda stage, waiting: calls.append((stage, waiting, time.monotonic())),
        )
        yield client, pools, calls
    await http.close()


async def test_hops_waiting_for_an_empty_pool_keep_telling_how_many_wait(
    hops: tuple[HopClient, Pools, list[tuple[int, int, float]]],
) -> None:
    client, pools, calls = hops
    t0 = time.monotonic()
    waiting = [asyncio.create_task(send(client, _input(f"wait-{i}", 20.0))) for i in range(2)]
    await asyncio.sleep(2.5)
    assert not any(t.done() for t in waiting)
    runner, replica = await _replica(200)
    try:
        pools.members.append(replica)  # the stage woke up: a replica joined its pool
        results = await asyncio.wait_for(asyncio.gather(*waiting), 10)
    finally:
        await runner.cleanup()
    assert [r.error for r in results] == [None, None]
    assert {stage for stage, _, _ in calls} == {STAGE}
    assert max(waiting for _, waiting, _ in calls) == 2
    # Told again while waiting (at least every EMPTY_POOL_NOTICE_S), not only once.
    times = sorted(t - t0 for _, _, t in calls)
    assert times[0] < 0.5 and times[-1] > 2.0, times


async def test_a_pool_of_busy_replicas_is_not_an_empty_one(
    hops: tuple[HopClient, Pools, list[tuple[int, int, float]]],
) -> None:
    client, pools, calls = hops
    runner, replica = await _replica(429)
    try:
        pools.members.append(replica)
        with pytest.raises(Exception, match="deadline"):
            await send(client, _input("busy", 1.0))
    finally:
        await runner.cleanup()
    assert calls == []


class CountingClient(ControlPlaneClient):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.wakes: list[tuple[int, int]] = []

    async def wake_stage(self, pipeline: str, stage_id: int, waiting: int = 1) -> ScaleStatus:
        self.wakes.append((stage_id, waiting))
        return await super().wake_stage(pipeline, stage_id, waiting)


async def test_the_waker_posts_at_most_every_few_seconds_and_a_real_cp_wakes_the_stage(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cp = start_control_plane(None, log_dir=tmp_path_factory.mktemp("cp"))
    client = CountingClient(cp.url)
    try:
        policy = AutoscaleConfig(min_replicas=0, max_replicas=3, scale_down_window_s=60)
        status = await client.set_scale_policy("synthetic", STAGE, policy, replicas=0)
        assert status.desired == 0
        waker = StageWaker(client, "synthetic", every_s=0.5)
        for _ in range(20):
            waker(STAGE, 2)
            waker(2, 1)  # stage 2 is not autoscaled: the 404 is no error
        await asyncio.sleep(0.2)
        assert sorted(client.wakes) == [(STAGE, 2), (2, 1)]
        await asyncio.sleep(0.4)
        waker(STAGE, 1)  # every_s later: posted again
        deadline = time.monotonic() + 10
        while (await client.scale("synthetic", STAGE)).desired != 2:
            assert time.monotonic() < deadline, await client.scale("synthetic", STAGE)
            await asyncio.sleep(0.1)
        assert client.wakes.count((STAGE, 1)) == 1
        decision = (await client.scale("synthetic", STAGE)).decision
        assert decision is not None and decision.reason == "wake"
        await waker.close()
    finally:
        await client.close()
        cp.proc.cleanup()
