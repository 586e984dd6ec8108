"""Shedding on the headers alone, through real processes: omni-cp, three synthetic stages and
an API server with one slot and a queue of two, stage 1 slow enough (5 s a request) that the
API server's queue stays full while the test sends.

A request the gate would shed is answered 503 before its body is read (a request whose body
never arrives is answered; a body that would be a 400 gets the 503); without the priority
header the request is shed on its headers only when the highest class its route accepts would
be; the sheds are counted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from tests.sidecar.topology import Topology, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DEPLOY = """\
request_timeout_s: 60
priority_classes: {/v1/generate: [normal, low]}
stages:
  - {stage_id: 0, max_inflight: 64, max_queue: 2, max_queue_wait_s: 30}
  - {stage_id: 1, max_inflight: 1, max_num_seqs: 1, step_latency_ms: 5000}
  - {stage_id: 2, max_inflight: 64}
"""


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    tmp = tmp_path_factory.mktemp("early-shed")
    deploy = tmp / "deploy.yaml"
    deploy.write_text(DEPLOY)
    before = shm_segments()
    extra = ["--deploy-config", str(deploy), "--api-max-inflight", "1"]
    t = Topology("synthetic", [1, 1, 1], tmp, extra_stage_args=extra)
    try:
        t.start()
        for stage_id in range(3):
            t.wait_discovered(stage_id, 1, timeout=30)
        yield t
    finally:
        t.close()
    assert shm_segments() - before == set()


def api_metric(topo: Topology, name: str, **labels: str) -> float:
    return topo.metric(topo.api_url, name, **labels)


@pytest.fixture
async def full_gate(topo: Topology) -> AsyncIterator[None]:
    """The API server's slot taken and its queue of two full (normal class) while the test
    runs; the requests are cancelled after it (the client goes away)."""
    session = aiohttp.ClientSession()
    url = f"{topo.api_url}/v1/generate"
    fillers = []
    try:
        for i in range(3):
            fillers.append(asyncio.create_task(session.post(url, json={"prompt": f"fill-{i}"})))
            await asyncio.sleep(0.1)
        for _ in range(100):
            queued = await asyncio.to_thread(
                api_metric, topo, "omni_stage_queue_length", priority="normal"
            )
            if queued == 2:
                break
            await asyncio.sleep(0.05)
        assert queued == 2, "the fillers did not queue at the API server"
        yield
    finally:
        for task in fillers:
            task.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
        await session.close()


async def raw_post(topo: Topology, path: str, headers: dict[str, str], body: bytes) -> bytes:
    """Headers (with ``Content-Length`` as given) and ``body``, which may be shorter than
    announced; the whole answer (the server closes or answers within 10 s)."""
    port = int(topo.api_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = answer.lower().split(b"\r\n")
        length = next(int(line[15:]) for line in lines if line.startswith(b"content-length:"))
        return answer + await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()


def split(answer: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


async def test_a_request_shed_on_its_headers_is_answered_before_its_body_arrives(
    topo: Topology, full_gate: None
) -> None:
    before = await asyncio.to_thread(
        api_metric, topo, "omni_stage_shed_total", reason="queue_full", priority="normal"
    )
    requests_before = await asyncio.to_thread(
        api_metric, topo, "omni_api_requests_total", route="/v1/generate", status="503"
    )
    # 100 kB announced, none sent: a server that read the body would never answer.
    headers = {"Content-Type": "application/json", "Content-Length": "100000"}
    status, got, body = split(
        await raw_post(topo, "/v1/generate", {**headers, "X-Omni-Priority": "normal"}, b"")
    )
    assert status == 503, body
    error = body["error"]
    assert isinstance(error, dict)
    assert error["type"] == "shed" and error["code"] == 503 and error["param"] is None
    assert str(error["message"]).startswith("shed (queue_full): the queue is full"), error
    assert got["X-Omni-Shed"] == "queue_full"
    assert int(got["Retry-After"]) >= 1
    # A body that would be a 400 (not JSON) is never decoded: the shed answers it.
    bad = b"this is not json"
    headers = {"Content-Type": "application/json", "Content-Length": str(len(bad))}
    status, got, body = split(
        await raw_post(topo, "/v1/generate", {**headers, "X-Omni-Priority": "low"}, bad)
    )
    assert status == 503 and got["X-Omni-Shed"] == "queue_full", body
    after = await asyncio.to_thread(
        api_metric, topo, "omni_stage_shed_total", reason="queue_full", priority="normal"
    )
    low = await asyncio.to_thread(
        api_metric, topo, "omni_stage_shed_total", reason="queue_full", priority="low"
    )
    requests_after = await asyncio.to_thread(
        api_metric, topo, "omni_api_requests_total", route="/v1/generate", status="503"
    )
    assert after - before == 1
    assert low >= 1
    assert requests_after - requests_before == 2


async def test_without_the_header_only_a_route_whose_top_class_is_shed_sheds_early(
    topo: Topology, full_gate: None
) -> None:
    bad = b"{not json"
    headers = {"Content-Type": "application/json", "Content-Length": str(len(bad))}
    # /v1/generate accepts normal and low only: even its top class would be shed.
    status, got, body = split(await raw_post(topo, "/v1/generate", headers, bad))
    assert status == 503 and got["X-Omni-Shed"] == "queue_full", body
    # /v1/audio/speech accepts high, which would evict a queued normal: the body is read,
    # and it is a bad one.
    status, _, body = split(await raw_post(topo, "/v1/audio/speech", headers, bad))
    assert status == 400, body
    assert "not valid JSON" in str(body["error"]["message"]), body  # type: ignore[index]
    # A header that is not a class: the route answers its 400 naming it, not a shed.
    headers["X-Omni-Priority"] = "urgent"
    status, _, body = split(await raw_post(topo, "/v1/generate", headers, bad))
    assert status == 400, body
    # The queue is as it was: none of these entered it.
    queued = await asyncio.to_thread(api_metric, topo, "omni_stage_queue_length")
    assert queued == 2
