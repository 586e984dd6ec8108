"""Under overload, through real processes: omni-cp, three synthetic stages and an API server,
the middle stage slow (100 ms a request, one at a time) so that its admission queue fills.

FIFO fairness, early shedding (503 + Retry-After at once, never run), priority classes
overtaking a backlog, tenant round-robin, and every request answered (200 or a shed 503).
No wall-clock performance assertions beyond generous bounds."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.sidecar.topology import Topology, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEP_S = 0.1
DEPLOY = f"""\
request_timeout_s: 60
stages:
  - {{stage_id: 0, max_inflight: 64}}
  - {{stage_id: 1, max_inflight: 1, max_num_seqs: 1, step_latency_ms: {STEP_S * 1000:g},
      max_queue: 64, max_queue_wait_s: 30}}
  - {{stage_id: 2, max_inflight: 64}}
"""


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    tmp = tmp_path_factory.mktemp("overload")
    deploy = tmp / "deploy.yaml"
    deploy.write_text(DEPLOY)
    before = shm_segments()
    t = Topology("synthetic", [1, 1, 1], tmp, extra_stage_args=["--deploy-config", str(deploy)])
    try:
        t.start()
        for stage_id in range(3):
            t.wait_discovered(stage_id, 1, timeout=30)
        yield t
    finally:
        t.close()
    assert shm_segments() - before == set()


class Client:
    """Sends requests to the API server and records when each one finished, and how."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: list[str] = []  # names in completion order (200s only)
        self.answers: dict[str, tuple[int, float, dict[str, object], dict[str, str]]] = {}

    async def send(
        self,
        session: aiohttp.ClientSession,
        name: str,
        *,
        priority: str | None = None,
        tenant: str | None = None,
        timeout_s: float | None = None,
    ) -> int:
        headers = {}
        if priority is not None:
            headers["X-Omni-Priority"] = priority
        if tenant is not None:
            headers["X-Omni-Tenant"] = tenant
        if timeout_s is not None:
            headers["X-Omni-Timeout-S"] = str(timeout_s)
        t0 = time.monotonic()
        body = {"prompt": name}
        async with session.post(f"{self.url}/v1/generate", json=body, headers=headers) as resp:
            payload = await resp.json()
            self.answers[name] = (resp.status, time.monotonic() - t0, payload, dict(resp.headers))
            if resp.status == 200:
                self.done.append(name)
            return resp.status

    async def burst(
        self, session: aiohttp.ClientSession, names: list[str], spacing_s: float = 0.0, **kw: str
    ) -> list[asyncio.Task[int]]:
        tasks = []
        for name in names:
            tasks.append(asyncio.create_task(self.send(session, name, **kw)))  # type: ignore[arg-type]
            await asyncio.sleep(spacing_s)
        return tasks


async def stage1_hops(topo: Topology) -> float:
    return await asyncio.to_thread(
        topo.metric, topo.urls[1][0], "omni_stage_requests_total", route="hop"
    )


async def warm(session: aiohttp.ClientSession, client: Client) -> None:
    """A few requests one after another: the slow stage measures its service time."""
    for i in range(3):
        assert await client.send(session, f"warm-{i}") == 200


async def test_fifo_fairness_and_no_request_lost(topo: Topology) -> None:
    client = Client(topo.api_url)
    async with aiohttp.ClientSession() as session:
        await warm(session, client)
        client.done.clear()
        names = [f"fifo-{i:02d}" for i in range(12)]
        tasks = await client.burst(session, names, spacing_s=0.03)
        statuses = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert statuses == [200] * len(names)  # 1.2 s of work, a 60 s deadline: nothing shed
    # Served in arrival order (a request may pass one sent 30 ms before it on the way in).
    displacement = [abs(client.done.index(n) - i) for i, n in enumerate(names)]
    assert max(displacement) <= 1, client.done
    latencies = sorted(client.answers[n][1] for n in names)
    assert latencies[-1] > 10 * STEP_S * 0.8  # the last waited for the others: it queued


async def test_a_request_that_cannot_meet_its_deadline_is_shed_at_once(topo: Topology) -> None:
    client = Client(topo.api_url)
    async with aiohttp.ClientSession() as session:
        await warm(session, client)
        hops_before = await stage1_hops(topo)
        tasks = await client.burst(session, [f"backlog-{i}" for i in range(10)], spacing_s=0.005)
        await asyncio.sleep(0.2)  # the backlog queues at the slow stage
        status = await client.send(session, "hopeless", timeout_s=0.4)
        statuses = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        hops_after = await stage1_hops(topo)
    _, seconds, body, headers = client.answers["hopeless"]
    assert status == 503, body
    error = body["error"]
    assert isinstance(error, dict) and error["type"] == "shed", error
    assert "deadline" in str(error["message"])
    assert int(headers["Retry-After"]) >= 1
    assert seconds < 0.3  # answered at arrival, not when its deadline ran out
    assert statuses == [200] * 10  # 0 lost: the backlog is served
    # The slow stage ran the backlog only: the shed request never started there.
    assert hops_after - hops_before == 10
    shed = topo.metric(topo.urls[1][0], "omni_stage_shed_total", reason="deadline")
    assert shed >= 1


async def test_a_shed_after_the_entry_stage_carries_its_retry_after_to_the_client(
    topo: Topology,
) -> None:
    """Stage 1 (not the entry stage) sheds: the client's Retry-After is the one stage 1
    computed (its queue's drain time, seconds here), not a default of 1."""
    client = Client(topo.api_url)
    async with aiohttp.ClientSession() as session:
        await warm(session, client)
        tasks = await client.burst(session, [f"deep-{i:02d}" for i in range(30)], spacing_s=0.002)
        await asyncio.sleep(0.3)  # ~3 s of backlog queues at the slow stage
        status = await client.send(session, "shed-deep", timeout_s=0.4)
        statuses = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    _, _, body, headers = client.answers["shed-deep"]
    assert status == 503, body
    error = body["error"]
    assert isinstance(error, dict) and error["type"] == "shed", error
    message = str(error["message"])
    assert message.startswith("stage 1: shed: every replica of stage 1 shed"), message
    found = re.search(r"; retry after ([0-9.]+) s$", message)
    assert found is not None, message
    computed_s = float(found.group(1))
    assert computed_s > 1.0, message  # the backlog takes seconds to drain
    assert headers["Retry-After"] == str(math.ceil(computed_s)), (headers, message)
    assert statuses == [200] * 30


async def test_high_priority_overtakes_a_low_priority_backlog(topo: Topology) -> None:
    client = Client(topo.api_url)
    async with aiohttp.ClientSession() as session:
        await warm(session, client)
        client.done.clear()
        lows = await client.burst(
            session, [f"low-{i:02d}" for i in range(12)], spacing_s=0.005, priority="low"
        )
        await asyncio.sleep(0.3)
        highs = await client.burst(session, ["high-0", "high-1"], priority="high")
        statuses = await asyncio.wait_for(asyncio.gather(*lows, *highs), 60)
    assert statuses == [200] * 14
    positions = [client.done.index(h) for h in ("high-0", "high-1")]
    # Sent when ~3 lows were done, they finish next (one low may already hold the slot).
    assert max(positions) <= 7, client.done
    low_after = [n for n in client.done[max(positions) :] if n.startswith("low")]
    assert len(low_after) >= 4
    high_s = max(client.answers[h][1] for h in ("high-0", "high-1"))
    low_s = max(client.answers[n][1] for n in client.done if n.startswith("low"))
    assert high_s < low_s / 2


async def test_one_tenants_burst_does_not_starve_another(topo: Topology) -> None:
    client = Client(topo.api_url)
    async with aiohttp.ClientSession() as session:
        await warm(session, client)
        client.done.clear()
        burst = await client.burst(
            session, [f"a-{i:02d}" for i in range(12)], spacing_s=0.005, tenant="tenant-a"
        )
        await asyncio.sleep(0.2)
        others = await client.burst(session, ["b-0", "b-1"], spacing_s=0.005, tenant="tenant-b")
        statuses = await asyncio.wait_for(asyncio.gather(*burst, *others), 60)
    assert statuses == [200] * 14
    b_positions = [client.done.index(n) for n in ("b-0", "b-1")]
    # Round-robin between tenants: b's requests interleave with a's backlog, they do not
    # wait behind all of it (FIFO would put them at 12 and 13).
    assert max(b_positions) <= 8, client.done


async def test_a_full_queue_sheds_and_answers_everyone(tmp_path: Path) -> None:
    """A tiny queue: whatever does not fit is shed (503 + Retry-After), the rest served."""
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        "stages:\n"
        "  - {stage_id: 0, max_inflight: 1, max_num_seqs: 1, step_latency_ms: 100,"
        " max_queue: 2}\n"
    )
    before = shm_segments()
    topo = Topology(
        "synthetic", [1, 1, 1], tmp_path, extra_stage_args=["--deploy-config", str(deploy)]
    )
    try:
        topo.start()
        for stage_id in range(3):
            topo.wait_discovered(stage_id, 1, timeout=30)
        client = Client(topo.api_url)
        async with aiohttp.ClientSession() as session:
            tasks = await client.burst(session, [f"r-{i}" for i in range(8)])
            statuses = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert sorted(set(statuses)) == [200, 503], statuses
        assert statuses.count(200) >= 3  # one running and two queued
        for status, _, body, headers in client.answers.values():
            if status == 503:
                assert body["error"]["type"] == "shed", body  # type: ignore[index]
                assert "Retry-After" in headers
    finally:
        topo.close()
    assert shm_segments() - before == set()
