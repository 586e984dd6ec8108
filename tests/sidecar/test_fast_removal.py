"""The fast path out of discovery: a sender whose connection to a replica fails reports it, the
control plane probes the replica and isolates it if it is dead.

- the router calls ``on_eject`` once per ejection, saying whether the failure was at the
  connection level (refused, reset) - not for a 5xx or a timeout;
- end to end: kill -9 of a stage-1 sidecar while requests flow, and the replica leaves the
  control plane's discovery within about a second (the lease is 3 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
from aiohttp import web

from omni_mesh.data_plane.connectors import HttpConnector
from omni_mesh.data_plane.messages import Payload, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.hop.budget import HopUnavailable
from omni_mesh.sidecar.hop.client import HOP_PATH, HopClient
from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.router import Replica, Router
from tests.sidecar.hops import send
from tests.sidecar.topology import (
    Topology,
    engine_pid,
    engine_tmp,
    http_get,
    post_json,
    wait_gone,
)

logger = logging.getLogger(__name__)

STAGE = 1


class Pools:
    def __init__(self, *replicas: Replica) -> None:
        self.members = list(replicas)

    def replicas(self, stage_id: int) -> Iterable[Replica]:
        return [r for r in self.members if r.stage_id == stage_id]


def replica(name: str, address: str = "http://127.0.0.1:1") -> Replica:
    return Replica(instance_id=name, stage_id=STAGE, address=address, host_id="host-b", capacity=8)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []

    def __call__(self, instance_id: str, reason: str, connection_level: bool) -> None:
        self.calls.append((instance_id, reason, connection_level))


# ---- the router's callback -------------------------------------------------------------------


@pytest.mark.unit
def test_on_eject_is_called_once_per_ejection() -> None:
    seen = Recorder()
    router = Router(Pools(replica("a"), replica("b")), host_id="h", eject_s=0.05, on_eject=seen)
    router.eject("a", "ClientConnectorError: refused", connection_level=True)
    router.eject("a", "ServerDisconnectedError", connection_level=True)
    router.eject("a", "status 503", connection_level=False)
    assert seen.calls == [("a", "ClientConnectorError: refused", True)]
    assert {r.instance_id for r in router.candidates(STAGE, set())} == {"b"}
    time.sleep(0.06)
    assert {r.instance_id for r in router.candidates(STAGE, set())} == {"a", "b"}
    router.eject("a", "refused again", connection_level=True)
    assert seen.calls[-1] == ("a", "refused again", True), "a new ejection, a new call"
    assert len(seen.calls) == 2


@pytest.mark.unit
def test_a_connection_failure_during_an_ejection_for_a_5xx_is_reported_once() -> None:
    seen = Recorder()
    router = Router(Pools(replica("a")), host_id="h", eject_s=30.0, on_eject=seen)
    router.eject("a", "status 503: draining")
    router.eject("a", "timed out")
    router.eject("a", "ClientOSError: reset", connection_level=True)
    router.eject("a", "ClientConnectorError: refused", connection_level=True)
    assert seen.calls == [
        ("a", "status 503: draining", False),
        ("a", "ClientOSError: reset", True),
    ]


@pytest.mark.unit
def test_a_failing_callback_does_not_break_routing(caplog: pytest.LogCaptureFixture) -> None:
    def broken(instance_id: str, reason: str, connection_level: bool) -> None:
        raise RuntimeError("bug")

    router = Router(Pools(replica("a"), replica("b")), host_id="h", on_eject=broken)
    router.eject("a", "refused", connection_level=True)
    assert {r.instance_id for r in router.candidates(STAGE, set())} == {"b"}
    assert "on_eject callback failed" in caplog.text


@pytest.mark.unit
def test_router_without_callback() -> None:
    router = Router(Pools(replica("a")), host_id="h")
    router.eject("a", "refused", connection_level=True)
    assert router.candidates(STAGE, set()) == []


# ---- HopClient tells the router what kind of failure it was ----------------------------------


@pytest.fixture
async def servers() -> AsyncIterator[dict[str, str]]:
    """Loopback addresses: 'refused' (nothing listens), 'dropped' (closes the connection
    without answering), 'busy503' (answers 503), 'slow' (never answers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused_port = s.getsockname()[1]

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    held: list[asyncio.StreamWriter] = []

    async def hang(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    dropper = await asyncio.start_server(drop, "127.0.0.1", 0)
    hanger = await asyncio.start_server(hang, "127.0.0.1", 0)

    async def unavailable(_: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded")

    app = web.Application()
    app.router.add_post(HOP_PATH, unavailable)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    addresses = {
        "refused": f"http://127.0.0.1:{refused_port}",
        "dropped": f"http://127.0.0.1:{dropper.sockets[0].getsockname()[1]}",
        "busy503": f"http://127.0.0.1:{runner.addresses[0][1]}",
        "slow": f"http://127.0.0.1:{hanger.sockets[0].getsockname()[1]}",
    }
    yield addresses
    for writer in held:
        writer.close()
    for server in (dropper, hanger):
        server.close()
        await server.wait_closed()
    await runner.cleanup()


@pytest.mark.integration
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kind", "connection_level"),
    [("refused", True), ("dropped", True), ("busy503", False), ("slow", False)],
)
async def test_hop_failures_are_reported_with_their_kind(
    servers: dict[str, str], kind: str, connection_level: bool
) -> None:
    seen = Recorder()
    router = Router(
        Pools(replica(kind, servers[kind])), host_id="h", rng=random.Random(1), on_eject=seen
    )
    deadline_s = 0.5 if kind == "slow" else 10.0
    si = StageInput(
        pipeline="synthetic",
        request_id="r1",
        stage_id=STAGE,
        from_stage=0,
        deadline_ms=int((time.time() + deadline_s) * 1000),
        seed=1,
        payload=Payload(fields={"prompt": "p"}),
    )
    with ShmReader() as reader:
        http = HopHttpClient()
        try:
            hop = HopClient(http, router, lambda a, b: HttpConnector(), reader, retries=0)
            with pytest.raises(HopUnavailable):
                await send(hop, si)
        finally:
            await http.close()
    if kind == "slow":  # slower than the request's deadline: not the replica's fault
        assert seen.calls == []
    else:
        assert [(c[0], c[2]) for c in seen.calls] == [(kind, connection_level)]


# ---- end to end: kill -9 with traffic --------------------------------------------------------


class Traffic:
    """Threads posting ``/v1/generate`` in a closed loop until stopped; records the statuses."""

    def __init__(self, url: str, workers: int = 4) -> None:
        self.url = url
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(n,), daemon=True) for n in range(workers)
        ]

    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            status, body = post_json(self.url, {"prompt": f"w{worker}-{n}"}, timeout=30)
            self.statuses.append(status)
            if status != 200:
                self.errors.append(body[:300].decode(errors="replace"))

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=35)


def logged_tracebacks(log_dir: Path) -> list[str]:
    """The tracebacks the pods logged (a 500 says only "internal error (logged)")."""
    found = []
    for log in sorted(log_dir.glob("*.err")):
        text = log.read_text(errors="replace")
        at = text.find("Traceback")
        if at >= 0:
            found.append(f"{log.name}: {text[max(0, at - 300) : at + 3000]}")
    return found


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_kill_9_with_traffic_leaves_discovery_within_a_second(tmp_path: Path) -> None:
    topo = Topology("synthetic", [1, 2, 1], tmp_path).start()
    try:
        topo.wait_discovered(1, 2)
        topo.wait_discovered(2, 1)
        victim, victim_url = topo.stages[1][1], topo.urls[1][1]
        survivor_url = topo.urls[1][0]
        with Traffic(topo.api_url + "/v1/generate") as traffic:
            deadline = time.monotonic() + 30
            while traffic.statuses.count(200) < 20:  # requests flow through both replicas
                assert time.monotonic() < deadline, traffic.errors[:3]
                time.sleep(0.05)
            engine = engine_pid(victim)
            victim_tmp = engine_tmp(engine)
            t_kill = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            removal_s = None
            while time.monotonic() - t_kill < 10:
                if victim_url not in topo.discovered(1):
                    removal_s = time.monotonic() - t_kill
                    break
                time.sleep(0.01)
            time.sleep(1.0)  # traffic keeps flowing on the survivor
        assert removal_s is not None, "the killed replica never left discovery"
        wait_gone(engine, 10)  # its engine follows it (SIGTERM) and removes its temp folder
        assert not victim_tmp.exists()
        logger.warning("kill -9 -> out of omni-cp discovery with traffic: %.3f s", removal_s)
        print(f"\nkill -9 -> out of omni-cp discovery with traffic: {removal_s:.3f} s")
        assert removal_s <= 1.5, f"took {removal_s:.3f}s (the lease alone takes ~3 s)"

        assert topo.discovered(1) == [survivor_url], "the survivor stays in the pool"
        assert traffic.statuses and set(traffic.statuses) == {200}, (
            traffic.errors[:3],
            logged_tracebacks(tmp_path),
        )
        assert topo.cp is not None
        everything = json.loads(
            http_get(f"{topo.cp.url}/v1/pipelines/synthetic/stages/1/instances?all=1")
        )["instances"]
        [dead] = [i for i in everything if i["address"] == victim_url]
        assert (dead["state"], dead["reason"]) == ("isolated", "unreachable")
        assert topo.metric(topo.cp.url, "omni_cp_isolations_total", reason="unreachable") >= 1
    finally:
        topo.close()
