"""Suspect reports (``POST /v1/instances/{id}/suspect``) against a real omni-cp: the control
plane probes the instance itself and isolates it (``unreachable``) only when its own probe
fails at the connection level; its next heartbeat readmits it. And the sidecar-side
:class:`SuspectReporter`."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from omni_mesh.control_plane.client import (
    ControlPlaneAuthError,
    ControlPlaneClient,
    InstanceState,
    InstanceUnknownError,
    LoadReport,
    ProbeOutcome,
    RegisterRequest,
    SuspectReporter,
)
from omni_mesh.control_plane.schema import clean_reason
from tests.procs import LOCALHOST, ControlPlaneProcess, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def reg(address: str, pipeline: str = "synthetic") -> RegisterRequest:
    return RegisterRequest(pipeline=pipeline, stage_id=1, address=address, capacity=4)


def refusing_address() -> str:
    """An address where nothing listens (connections are refused)."""
    return f"http://{LOCALHOST}:{free_port()}"


def metric(cp: ControlPlaneProcess, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    with urllib.request.urlopen(f"{cp.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


@dataclass
class HealthServer:
    """A tiny aiohttp server answering ``GET /health`` (after ``delay_s``) with ``status``."""

    status: int = 200
    delay_s: float = 0.0
    hits: int = 0
    address: str = ""
    runner: web.AppRunner | None = field(default=None, repr=False)

    async def start(self) -> HealthServer:
        async def health(_: web.Request) -> web.Response:
            self.hits += 1
            await asyncio.sleep(self.delay_s)
            return web.json_response({"status": "busy"}, status=self.status)

        app = web.Application()
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((LOCALHOST, 0))
        port = sock.getsockname()[1]
        await web.SockSite(self.runner, sock).start()
        self.address = f"http://{LOCALHOST}:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


HealthServerFactory = Callable[..., Awaitable[HealthServer]]


@pytest.fixture
async def health_server() -> AsyncIterator[HealthServerFactory]:
    servers: list[HealthServer] = []

    async def make(status: int = 200, delay_s: float = 0.0) -> HealthServer:
        server = HealthServer(status=status, delay_s=delay_s)
        servers.append(server)
        return await server.start()

    yield make
    for server in servers:
        await server.stop()


async def state_of(client: ControlPlaneClient, pipeline: str, instance_id: str) -> tuple[str, str]:
    listing = await client.pipelines()
    for status in listing.pipelines:
        for info in status.instances:
            if info.instance_id == instance_id:
                return info.state.value, info.reason
    raise AssertionError(f"instance {instance_id} not listed")


# ---- a dead instance leaves discovery within one call ----------------------------------------


async def test_suspect_of_a_refusing_instance_isolates_it_at_once(
    fast_cp: ControlPlaneProcess, fast_client: ControlPlaneClient
) -> None:
    request = reg(refusing_address())
    registration = await fast_client.register(request)
    iid = registration.instance_id
    before = await fast_client.instances(request.pipeline, request.stage_id)
    assert iid in {i.instance_id for i in before.instances}
    labels = {"pipeline": request.pipeline, "stage": str(request.stage_id)}
    suspects0 = metric(fast_cp, "omni_cp_suspects_total", **labels)
    isolations0 = metric(fast_cp, "omni_cp_isolations_total", reason="unreachable", **labels)
    watch = asyncio.create_task(
        fast_client.watch(request.pipeline, since=before.version, timeout_s=5)
    )
    await asyncio.sleep(0.05)  # the watch is parked on the current version

    t0 = time.monotonic()
    result = await fast_client.suspect(iid, "connection refused", reporter="test-sender")
    elapsed = time.monotonic() - t0
    assert result.isolated and result.probe is ProbeOutcome.REFUSED and not result.cached
    assert (result.state, result.reason) == (InstanceState.ISOLATED, "unreachable")
    assert elapsed < 0.5, f"one probe of a refusing port took {elapsed:.3f}s"

    snapshot = await asyncio.wait_for(watch, 5)
    assert snapshot.version > before.version
    assert iid not in {i.instance_id for i in snapshot.healthy(request.stage_id)}
    after = await fast_client.instances(request.pipeline, request.stage_id)
    assert iid not in {i.instance_id for i in after.instances}
    everything = await fast_client.instances(request.pipeline, request.stage_id, all=True)
    [info] = [i for i in everything.instances if i.instance_id == iid]
    assert (info.state, info.reason) == (InstanceState.ISOLATED, "unreachable")

    assert metric(fast_cp, "omni_cp_suspects_total", **labels) == suspects0 + 1
    assert metric(fast_cp, "omni_cp_probes_total", outcome="refused", **labels) >= 1
    assert (
        metric(fast_cp, "omni_cp_isolations_total", reason="unreachable", **labels)
        == isolations0 + 1
    )

    again = await fast_client.suspect(iid, "connection refused")
    assert again.isolated and again.probe is ProbeOutcome.SKIPPED, "already out: no probe"
    await fast_client.deregister(iid)


async def test_suspect_of_a_hanging_instance_isolates_it_after_the_probe_timeout(
    fast_client: ControlPlaneClient,
) -> None:
    held: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accept the connection, read nothing, answer nothing

    server = await asyncio.start_server(never_answer, LOCALHOST, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        registration = await fast_client.register(reg(f"http://{LOCALHOST}:{port}"))
        t0 = time.monotonic()
        result = await fast_client.suspect(registration.instance_id, "connection reset")
        elapsed = time.monotonic() - t0
        assert result.isolated and result.probe is ProbeOutcome.TIMEOUT, result
        assert 0.3 <= elapsed < 1.5
        await fast_client.deregister(registration.instance_id)
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


# ---- a live instance stays -------------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 503])
async def test_suspect_of_an_instance_that_answers_leaves_it_in_discovery(
    fast_cp: ControlPlaneProcess,
    fast_client: ControlPlaneClient,
    health_server: HealthServerFactory,
    status: int,
) -> None:
    server = await health_server(status=status)
    request = reg(server.address)
    registration = await fast_client.register(request)
    iid = registration.instance_id
    result = await fast_client.suspect(iid, "connection refused", reporter="confused-sender")
    assert not result.isolated and result.probe is ProbeOutcome.ANSWERED
    assert result.detail == f"HTTP {status}", "any HTTP answer means the process is alive"
    assert result.state is InstanceState.HEALTHY
    assert server.hits == 1
    pool = await fast_client.instances(request.pipeline, request.stage_id)
    assert iid in {i.instance_id for i in pool.instances}
    labels = {"pipeline": request.pipeline, "stage": str(request.stage_id)}
    assert metric(fast_cp, "omni_cp_probes_total", outcome="answered", **labels) >= 1
    await fast_client.deregister(iid)


async def test_concurrent_suspects_share_one_probe(
    fast_client: ControlPlaneClient, health_server: HealthServerFactory
) -> None:
    server = await health_server(delay_s=0.2)  # slow enough for the reports to overlap
    registration = await fast_client.register(reg(server.address))
    iid = registration.instance_id
    results = await asyncio.gather(
        *(fast_client.suspect(iid, f"refused #{n}", reporter=f"s{n}") for n in range(10))
    )
    assert server.hits == 1, "one probe at a time per instance"
    assert all(not r.isolated and r.probe is ProbeOutcome.ANSWERED for r in results)
    assert sum(not r.cached for r in results) == 1
    burst = await fast_client.suspect(iid, "refused again")
    assert burst.cached and server.hits == 1, "a fresh result is reused (rate limit)"
    await asyncio.sleep(0.6)
    later = await fast_client.suspect(iid, "refused again")
    assert not later.cached and server.hits == 2, "after the interval it probes again"
    await fast_client.deregister(iid)


async def test_concurrent_suspects_of_a_dead_instance_isolate_it_once(
    fast_cp: ControlPlaneProcess, fast_client: ControlPlaneClient
) -> None:
    request = reg(refusing_address(), pipeline="tiny-image")
    registration = await fast_client.register(request)
    labels = {"pipeline": request.pipeline, "stage": str(request.stage_id)}
    probes0 = metric(fast_cp, "omni_cp_probes_total", **labels)
    isolations0 = metric(fast_cp, "omni_cp_isolations_total", reason="unreachable", **labels)
    results = await asyncio.gather(
        *(fast_client.suspect(registration.instance_id, "refused") for _ in range(8))
    )
    assert all(r.isolated for r in results)
    assert metric(fast_cp, "omni_cp_probes_total", **labels) == probes0 + 1
    assert (
        metric(fast_cp, "omni_cp_isolations_total", reason="unreachable", **labels)
        == isolations0 + 1
    )
    await fast_client.deregister(registration.instance_id)


# ---- readmission and the operator's decisions ------------------------------------------------


async def test_heartbeat_readmits_an_unreachable_instance(fast_client: ControlPlaneClient) -> None:
    request = reg(refusing_address())
    registration = await fast_client.register(request)
    iid = registration.instance_id
    assert (await fast_client.suspect(iid, "connection refused")).isolated
    await asyncio.sleep(0.3)  # past the grace for a heartbeat sent just before the death
    ack = await fast_client.heartbeat(iid, LoadReport())
    assert (ack.state, ack.reason) == (InstanceState.HEALTHY, "")
    pool = await fast_client.instances(request.pipeline, request.stage_id)
    assert iid in {i.instance_id for i in pool.instances}
    await fast_client.deregister(iid)


async def test_suspect_leaves_operator_isolation_and_draining_alone(
    fast_client: ControlPlaneClient,
) -> None:
    for action in ("isolate", "drain"):
        registration = await fast_client.register(reg(refusing_address(), pipeline="tiny-tts"))
        iid = registration.instance_id
        before = await getattr(fast_client, action)(iid, "maintenance")
        result = await fast_client.suspect(iid, "connection refused")
        assert result.probe is ProbeOutcome.SKIPPED
        assert (result.state, result.reason) == (before.state, "maintenance")
        await asyncio.sleep(0.3)
        ack = await fast_client.heartbeat(iid, LoadReport())
        assert (ack.state, ack.reason) == (before.state, "maintenance"), "heartbeat keeps it"
        await fast_client.deregister(iid)


async def test_unknown_instance_is_404(
    fast_client: ControlPlaneClient, fast_cp: ControlPlaneProcess
) -> None:
    with pytest.raises(InstanceUnknownError) as err:
        await fast_client.suspect("0123abcd", "connection refused")
    assert err.value.status == 404 and err.value.field == "instance_id"
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{fast_cp.url}/v1/instances/not%20an%20id/suspect", json={"reason": "x"}
        ) as resp,
    ):
        assert resp.status == 404
        assert (await resp.json())["error"]["param"] == "instance_id"


async def test_suspect_needs_the_bearer_token(
    cp_factory: Callable[..., ControlPlaneProcess],
) -> None:
    cp = cp_factory(auth_token="s3cret")
    async with ControlPlaneClient([cp.url], auth_token="s3cret") as good:
        registration = await good.register(reg(refusing_address()))
        async with ControlPlaneClient([cp.url]) as anonymous:
            with pytest.raises(ControlPlaneAuthError):
                await anonymous.suspect(registration.instance_id, "connection refused")
        async with ControlPlaneClient([cp.url], auth_token="wrong") as bad:
            with pytest.raises(ControlPlaneAuthError):
                await bad.suspect(registration.instance_id, "connection refused")
        state = await state_of(good, "synthetic", registration.instance_id)
        assert state == ("healthy", ""), "a refused report changes nothing"
        result = await good.suspect(registration.instance_id, "connection refused")
        assert result.isolated and result.reason == "unreachable"


# ---- the client side -------------------------------------------------------------------------


def test_clean_reason_makes_any_text_acceptable() -> None:
    assert clean_reason("ClientConnectorError: refused\n  on 127.0.0.1") == (
        "ClientConnectorError: refused on 127.0.0.1"
    )
    assert clean_reason("caf\u00e9 \x00") == "caf? ?"
    long = clean_reason("x" * 500)
    assert len(long) == 128 and long.endswith("...")
    assert clean_reason("  ") == "unspecified"


async def test_client_sends_any_reason_text(fast_client: ControlPlaneClient) -> None:
    registration = await fast_client.register(reg(refusing_address()))
    result = await fast_client.suspect(
        registration.instance_id, "ServerDisconnectedError: \u2014 " + "y" * 400, reporter="\u00e9"
    )
    assert result.isolated
    await fast_client.deregister(registration.instance_id)


async def test_reporter_reports_connection_level_ejections_once(
    fast_client: ControlPlaneClient,
) -> None:
    registration = await fast_client.register(reg(refusing_address()))
    iid = registration.instance_id
    reporter = SuspectReporter(fast_client, reporter="test")
    reporter(iid, "status 503: busy", False)
    assert reporter.sent == 0, "only connection-level failures are reported"
    reporter(iid, "ClientConnectorError: refused", True)
    reporter(iid, "ClientConnectorError: refused", True)
    assert reporter.sent == 1, "one report in flight per instance"
    deadline = time.monotonic() + 5
    while (await state_of(fast_client, "synthetic", iid))[0] != "isolated":
        assert time.monotonic() < deadline, "the report did not isolate the instance"
        await asyncio.sleep(0.02)
    await reporter.close()
    reporter(iid, "refused", True)
    assert reporter.sent == 1, "a closed reporter sends nothing"
    await fast_client.deregister(iid)


async def test_reporter_survives_an_unreachable_control_plane(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG", logger="omni_mesh.control_plane.client.suspects")
    async with ControlPlaneClient([refusing_address()], timeout_s=1.0) as client:
        reporter = SuspectReporter(client)
        reporter("abcdef", "ClientConnectorError: refused", True)
        deadline = time.monotonic() + 5
        while not any("not delivered" in r.message for r in caplog.records):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert all(r.levelname == "DEBUG" for r in caplog.records)
        await reporter.close()


async def test_reporter_close_cancels_reports_in_flight() -> None:
    held: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(never_answer, LOCALHOST, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with ControlPlaneClient([f"http://{LOCALHOST}:{port}"], timeout_s=30) as client:
            reporter = SuspectReporter(client)
            reporter("abcdef", "refused", True)
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await reporter.close()
            assert time.monotonic() - t0 < 1.0
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
