"""The open-loop generator of the overload benchmark against a small aiohttp server in this
process: arrivals on schedule, latency counted from the scheduled send time, sheds told from
failures, a request lost only when it gets no proper answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from benchmarks.openloop import open_loop
from omni_mesh.procutil import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

HOLD_S = 0.05
seen: list[str] = []  # the X-Omni-Priority of every request the server read


async def answer(request: web.Request) -> web.Response:
    body = await request.json()
    seen.append(request.headers.get("X-Omni-Priority", ""))
    if body["prompt"] == "shed":
        return web.json_response({"error": {"type": "shed"}}, status=503)
    if body["prompt"] == "fail":
        return web.json_response({"error": {"type": "internal_error"}}, status=500)
    await asyncio.sleep(HOLD_S)
    return web.json_response({"ok": True})


@pytest.fixture
async def port() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_post("/v1/generate", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port
    await runner.cleanup()


async def test_arrivals_on_schedule_and_latency_from_the_schedule(port: int) -> None:
    seen.clear()
    res = await open_loop(
        port, 200.0, 0.5, conns=4, max_conns=64, timeout_s=10, headers={"X-Omni-Priority": "low"}
    )
    assert len(res.status) == 100 and res.status == [200] * 100 and not res.lost
    assert res.scheduled[:3] == pytest.approx([0.0, 0.005, 0.01])
    # Four connections opened first, more as the 50 ms answers kept them busy (10 at once).
    assert 4 < res.connections <= 64
    assert min(res.latency) >= HOLD_S
    assert max(res.send_lag) < 0.5
    assert seen == ["low"] * 100


async def test_sheds_are_answers_and_other_errors_are_lost(port: int) -> None:
    shed = await open_loop(port, 100.0, 0.1, body=b'{"prompt": "shed"}', conns=2, timeout_s=10)
    assert shed.status == [503] * 10 and not shed.lost
    failed = await open_loop(port, 100.0, 0.1, body=b'{"prompt": "fail"}', conns=2, timeout_s=10)
    assert failed.status == [-500] * 10
    assert len(failed.lost) == 10 and failed.lost[0].startswith("HTTP 500")


async def test_a_request_with_no_answer_is_lost(port: int) -> None:
    res = await open_loop(port, 50.0, 0.1, conns=1, max_conns=1, timeout_s=0.01)
    # One connection, answers take 50 ms, 10 ms to wait after the last arrival: most are lost.
    assert res.status.count(-1) >= 1
    assert any(why.startswith("no answer within") for why in res.lost)
