"""The HTTP API of a real ``omni-cp`` process (lease 1 s, sweep 100 ms) on the session Redis."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    InstanceState,
    InstanceUnknownError,
    LoadReport,
    PipelineSnapshot,
    RegisterRequest,
)
from tests.control_plane.conftest import FAST_LEASE_MS, FAST_SWEEP_MS
from tests.procs import ControlPlaneProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

_ports = itertools.count(20000)


def reg(pipeline: str = "tiny-omni", stage_id: int = 1, **kw: object) -> RegisterRequest:
    fields: dict[str, object] = {
        "pipeline": pipeline,
        "stage_id": stage_id,
        "address": f"http://127.0.0.1:{next(_ports)}",
        "capacity": 4,
    }
    fields.update(kw)
    return RegisterRequest.model_validate(fields)


async def healthy_ids(client: ControlPlaneClient, pipeline: str, stage_id: int) -> set[str]:
    return {i.instance_id for i in (await client.instances(pipeline, stage_id)).instances}


async def keep_alive(client: ControlPlaneClient, instance_id: str) -> None:
    while True:
        await client.heartbeat(instance_id, LoadReport(in_flight=1, capacity=4))
        await asyncio.sleep(0.2)


@pytest.fixture
async def session(fast_cp: ControlPlaneProcess) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=fast_cp.url) as s:
        yield s


async def test_register_discover_heartbeat_deregister(fast_client: ControlPlaneClient) -> None:
    request = reg(labels={"role": "headless"}, host_id="node-a")
    registration = await fast_client.register(request)
    assert registration.lease_ttl_ms == FAST_LEASE_MS
    assert registration.heartbeat_interval_ms == 200
    pool = await fast_client.instances("tiny-omni", 1)
    [info] = [i for i in pool.instances if i.instance_id == registration.instance_id]
    assert info.model_dump(include={"address", "host_id", "capacity", "labels", "state"}) == {
        "address": request.address,
        "host_id": "node-a",
        "capacity": 4,
        "labels": {"role": "headless"},
        "state": InstanceState.HEALTHY,
    }
    assert info.epoch == registration.epoch and info.pipeline == "tiny-omni"

    load = LoadReport(in_flight=3, queued=2, capacity=4, engine={"kv_cache_usage": 0.5})
    ack = await fast_client.heartbeat(registration.instance_id, load)
    assert ack.state is InstanceState.HEALTHY and ack.epoch == registration.epoch
    after = await fast_client.instances("tiny-omni", 1)
    assert after.version == pool.version, "heartbeats do not bump the version"
    [info] = [i for i in after.instances if i.instance_id == registration.instance_id]
    assert info.load == load

    await fast_client.deregister(registration.instance_id)
    assert registration.instance_id not in await healthy_ids(fast_client, "tiny-omni", 1)
    assert (await fast_client.instances("tiny-omni", 1)).version > pool.version
    with pytest.raises(InstanceUnknownError):
        await fast_client.heartbeat(registration.instance_id, LoadReport())
    with pytest.raises(InstanceUnknownError):
        await fast_client.deregister(registration.instance_id)


async def test_silent_instance_leaves_discovery_within_lease_plus_1s(
    fast_client: ControlPlaneClient,
) -> None:
    registration = await fast_client.register(reg(pipeline="tiny-tts", stage_id=0))
    started = time.monotonic()
    while registration.instance_id in await healthy_ids(fast_client, "tiny-tts", 0):
        assert time.monotonic() - started < FAST_LEASE_MS / 1000 + 1.0, "still listed"
        await asyncio.sleep(0.02)
    elapsed = time.monotonic() - started
    assert elapsed >= FAST_LEASE_MS / 1000 - 0.1
    everything = await fast_client.instances("tiny-tts", 0, all=True)
    [info] = [i for i in everything.instances if i.instance_id == registration.instance_id]
    assert (info.state, info.reason) == (InstanceState.ISOLATED, "lease_expired")
    assert info.heartbeat_age_ms >= FAST_LEASE_MS

    ack = await fast_client.heartbeat(registration.instance_id, LoadReport())
    assert ack.state is InstanceState.HEALTHY, "a lease-isolated instance returns on heartbeat"
    assert registration.instance_id in await healthy_ids(fast_client, "tiny-tts", 0)
    await fast_client.deregister(registration.instance_id)


async def test_isolate_readmit_drain(fast_client: ControlPlaneClient) -> None:
    registration = await fast_client.register(reg(pipeline="tiny-image", stage_id=1))
    iid = registration.instance_id
    beat = asyncio.create_task(keep_alive(fast_client, iid))
    try:
        info = await fast_client.isolate(iid, reason="bad gpu")
        assert (info.state, info.reason) == (InstanceState.ISOLATED, "bad gpu")
        assert iid not in await healthy_ids(fast_client, "tiny-image", 1)
        await asyncio.sleep(0.5)  # heartbeats keep coming: operator isolation stays
        ack = await fast_client.heartbeat(iid, LoadReport())
        assert (ack.state, ack.reason) == (InstanceState.ISOLATED, "bad gpu")
        listed = await fast_client.instances("tiny-image", 1, all=True)
        assert [(i.state, i.reason) for i in listed.instances if i.instance_id == iid] == [
            (InstanceState.ISOLATED, "bad gpu")
        ]

        info = await fast_client.readmit(iid)
        assert info.state is InstanceState.HEALTHY and info.reason == ""
        assert iid in await healthy_ids(fast_client, "tiny-image", 1)

        info = await fast_client.drain(iid)
        assert (info.state, info.reason) == (InstanceState.DRAINING, "drain")
        assert iid not in await healthy_ids(fast_client, "tiny-image", 1)
        await asyncio.sleep(0.5)
        ack = await fast_client.heartbeat(iid, LoadReport())
        assert ack.state is InstanceState.DRAINING
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
    await fast_client.deregister(iid)


async def test_operator_actions_on_unknown_instance_are_404(
    fast_client: ControlPlaneClient,
) -> None:
    for action in (fast_client.isolate, fast_client.readmit, fast_client.drain):
        with pytest.raises(InstanceUnknownError):
            await action("0123456789abcdef")


async def test_watch_answers_at_once_for_an_old_version(fast_client: ControlPlaneClient) -> None:
    registration = await fast_client.register(reg(stage_id=2))
    current = await fast_client.watch("tiny-omni", None, timeout_s=0)
    assert registration.instance_id in {i.instance_id for i in current.healthy(2)}
    assert set(current.stages) == {0, 1, 2}
    started = time.monotonic()
    snap = await fast_client.watch("tiny-omni", current.version - 1, timeout_s=20)
    assert time.monotonic() - started < 1.0
    assert snap.version == current.version
    started = time.monotonic()
    stale = await fast_client.watch("tiny-omni", 1, timeout_s=20)  # e.g. from before a restart
    assert time.monotonic() - started < 1.0 and stale.version == current.version
    await fast_client.deregister(registration.instance_id)


async def test_watch_times_out_with_the_unchanged_snapshot(
    fast_client: ControlPlaneClient,
) -> None:
    current = await fast_client.watch("synthetic", None, timeout_s=0)
    started = time.monotonic()
    snap = await fast_client.watch("synthetic", current.version, timeout_s=0.5)
    assert 0.45 <= time.monotonic() - started < 3.0
    assert snap.version == current.version


async def _watch_change(
    client: ControlPlaneClient, pipeline: str, change: Callable[[], Awaitable[object]]
) -> tuple[PipelineSnapshot, float]:
    current = await client.watch(pipeline, None, timeout_s=0)
    waiter = asyncio.create_task(client.watch(pipeline, current.version, timeout_s=20))
    await asyncio.sleep(0.3)
    assert not waiter.done(), "the watch must wait while nothing changes"
    started = time.monotonic()
    await change()
    snap = await waiter
    assert snap.version != current.version
    return snap, time.monotonic() - started


async def test_watch_wakes_on_registration(fast_client: ControlPlaneClient) -> None:
    request = reg(pipeline="synthetic", stage_id=2)
    snap, elapsed = await _watch_change(
        fast_client, "synthetic", lambda: fast_client.register(request)
    )
    assert elapsed < 1.0
    assert request.address in {i.address for i in snap.healthy(2)}
    # Leave now: its lease running out during the next test would be that test's change.
    (mine,) = [i for i in snap.healthy(2) if i.address == request.address]
    await fast_client.deregister(mine.instance_id)


async def test_watch_sees_lease_expiry_within_one_sweeper_tick(
    fast_client: ControlPlaneClient,
) -> None:
    registration = await fast_client.register(reg(pipeline="synthetic", stage_id=1))
    registered_at = time.monotonic()
    snap, _ = await _watch_change(fast_client, "synthetic", lambda: asyncio.sleep(0))
    elapsed = time.monotonic() - registered_at
    assert registration.instance_id not in {i.instance_id for i in snap.healthy(1)}
    # lease + one sweeper tick + slack for a loaded 2-core machine
    assert elapsed < FAST_LEASE_MS / 1000 + FAST_SWEEP_MS / 1000 + 1.0


async def test_sse_stream_sends_an_event_per_snapshot(
    fast_client: ControlPlaneClient, session: aiohttp.ClientSession
) -> None:
    headers = {"Accept": "text/event-stream"}
    async with session.get("/v1/watch?pipeline=tiny-tts", headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")

        async def next_event() -> tuple[int, PipelineSnapshot]:
            fields: dict[str, str] = {}
            async with asyncio.timeout(5):
                while True:
                    line = (await resp.content.readline()).decode().rstrip("\n")
                    if not line:
                        if "data" in fields:
                            break
                        continue
                    if line.startswith(":"):
                        continue
                    key, _, value = line.partition(": ")
                    fields[key] = value
            assert fields["event"] == "snapshot"
            return int(fields["id"]), PipelineSnapshot.model_validate_json(fields["data"])

        first_id, first = await next_event()
        assert first_id == first.version
        request = reg(pipeline="tiny-tts", stage_id=1)
        registration = await fast_client.register(request)
        second_id, second = await next_event()
        assert second_id > first_id
        assert registration.instance_id in {i.instance_id for i in second.healthy(1)}
    await fast_client.deregister(registration.instance_id)


async def test_pipelines_lists_every_instance(fast_client: ControlPlaneClient) -> None:
    registration = await fast_client.register(reg(pipeline="tiny-image", stage_id=0))
    await fast_client.isolate(registration.instance_id, reason="maintenance")
    listing = await fast_client.pipelines()
    by_name = {p.pipeline: p for p in listing.pipelines}
    mine = [i for i in by_name["tiny-image"].instances if i.instance_id == registration.instance_id]
    assert [(i.state, i.reason) for i in mine] == [(InstanceState.ISOLATED, "maintenance")]
    await fast_client.deregister(registration.instance_id)


async def test_healthz_and_metrics(
    fast_client: ControlPlaneClient, session: aiohttp.ClientSession
) -> None:
    assert (await fast_client.health()).redis
    await fast_client.register(reg(pipeline="tiny-omni", stage_id=0))
    async with session.get("/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    for needle in (
        'omni_cp_instances{pipeline="tiny-omni",stage="0",state="healthy"}',
        'omni_cp_registrations_total{pipeline="tiny-omni",stage="0"}',
        'omni_cp_http_request_duration_seconds_bucket{le="0.001",method="POST",'
        'route="/v1/instances",status="201"}',
        "omni_cp_sweeper_leader 1.0",
        'omni_cp_watchers{mode="longpoll"}',
    ):
        assert needle in text, needle


# ---- untrusted input: every bad request is a 4xx that names the field -------------------------

GOOD = {"pipeline": "tiny-omni", "stage_id": 1, "address": "http://127.0.0.1:9100", "capacity": 4}


def body(**changes: object) -> bytes:
    fields: dict[str, object] = dict(GOOD)
    for key, value in changes.items():
        if value is ...:
            fields.pop(key)
        else:
            fields[key] = value
    return json.dumps(fields).encode()


BAD_INPUTS = [
    # (id, method, path, body, status, field, stage)
    ("missing-pipeline", "POST", "/v1/instances", body(pipeline=...), 400, "pipeline", None),
    ("unknown-pipeline", "POST", "/v1/instances", body(pipeline="nope"), 400, "pipeline", None),
    ("stage-not-in-pipeline", "POST", "/v1/instances", body(pipeline="tiny-tts", stage_id=2),
     400, "stage_id", 2),
    ("stage-negative", "POST", "/v1/instances", body(stage_id=-1), 400, "stage_id", None),
    ("stage-string", "POST", "/v1/instances", body(stage_id="1"), 400, "stage_id", None),
    ("stage-huge", "POST", "/v1/instances", body(stage_id=10**30), 400, "stage_id", None),
    ("address-scheme", "POST", "/v1/instances", body(address="ftp://h:1"), 400, "address", None),
    ("address-no-port", "POST", "/v1/instances", body(address="http://h"), 400, "address", None),
    ("address-garbage", "POST", "/v1/instances", body(address="not a url"), 400, "address", None),
    ("address-bad-port", "POST", "/v1/instances", body(address="http://h:99999"), 400, "address",
     None),
    ("address-number", "POST", "/v1/instances", body(address=80), 400, "address", None),
    ("capacity-zero", "POST", "/v1/instances", body(capacity=0), 400, "capacity", None),
    ("capacity-huge", "POST", "/v1/instances", body(capacity=65537), 400, "capacity", None),
    ("capacity-bool", "POST", "/v1/instances", body(capacity=True), 400, "capacity", None),
    ("capacity-missing", "POST", "/v1/instances", body(capacity=...), 400, "capacity", None),
    ("labels-too-many", "POST", "/v1/instances",
     body(labels={f"k{i}": "v" for i in range(33)}), 400, "labels", None),
    ("label-too-long", "POST", "/v1/instances", body(labels={"k": "v" * 300}), 400, "labels.k",
     None),
    ("label-not-string", "POST", "/v1/instances", body(labels={"k": 1}), 400, "labels.k", None),
    ("host-id-bad", "POST", "/v1/instances", body(host_id="a b"), 400, "host_id", None),
    ("unknown-field", "POST", "/v1/instances", body(colour="red"), 400, "colour", None),
    ("not-json", "POST", "/v1/instances", b"{nope", 400, "body", None),
    ("json-array", "POST", "/v1/instances", b"[1, 2]", 400, "body", None),
    ("empty-body", "POST", "/v1/instances", b"", 400, "body", None),
    ("too-large", "POST", "/v1/instances", b"{" + b" " * (65 * 1024) + b"}", 413, "body", None),
    ("heartbeat-negative", "PUT", "/v1/instances/{id}/heartbeat",
     b'{"load": {"in_flight": -1}}', 400, "load.in_flight", None),
    ("heartbeat-nan", "PUT", "/v1/instances/{id}/heartbeat",
     b'{"load": {"engine": {"x": NaN}}}', 400, "load.engine.x", None),
    ("heartbeat-unknown-field", "PUT", "/v1/instances/{id}/heartbeat",
     b'{"load": {"busy": 1}}', 400, "load.busy", None),
    ("heartbeat-unknown-instance", "PUT", "/v1/instances/ffff/heartbeat", b"{}", 404,
     "instance_id", None),
    ("isolate-reserved-reason", "POST", "/v1/instances/{id}/isolate",
     b'{"reason": "lease_expired"}', 400, "reason", None),
    ("isolate-long-reason", "POST", "/v1/instances/{id}/isolate",
     json.dumps({"reason": "r" * 200}).encode(), 400, "reason", None),
    ("isolate-unreachable-reason", "POST", "/v1/instances/{id}/isolate",
     b'{"reason": "unreachable"}', 400, "reason", None),
    ("drain-reserved-reason", "POST", "/v1/instances/{id}/drain",
     b'{"reason": "lease_expired"}', 400, "reason", None),
    ("suspect-no-reason", "POST", "/v1/instances/{id}/suspect", b"{}", 400, "reason", None),
    ("suspect-empty-body", "POST", "/v1/instances/{id}/suspect", b"", 400, "body", None),
    ("suspect-not-json", "POST", "/v1/instances/{id}/suspect", b"{nope", 400, "body", None),
    ("suspect-reason-number", "POST", "/v1/instances/{id}/suspect", b'{"reason": 1}', 400,
     "reason", None),
    ("suspect-reason-newline", "POST", "/v1/instances/{id}/suspect", b'{"reason": "a\\nb"}',
     400, "reason", None),
    ("suspect-reporter-long", "POST", "/v1/instances/{id}/suspect",
     json.dumps({"reason": "x", "reporter": "r" * 300}).encode(), 400, "reporter", None),
    ("suspect-unknown-field", "POST", "/v1/instances/{id}/suspect",
     b'{"reason": "x", "colour": "red"}', 400, "colour", None),
    ("suspect-unknown-instance", "POST", "/v1/instances/ffff/suspect", b'{"reason": "x"}', 404,
     "instance_id", None),
    ("readmit-with-fields", "POST", "/v1/instances/{id}/readmit", b'{"force": true}', 400,
     "force", None),
    ("pool-unknown-pipeline", "GET", "/v1/pipelines/nope/stages/0/instances", b"", 400,
     "pipeline", None),
    ("pool-stage-not-int", "GET", "/v1/pipelines/tiny-omni/stages/x/instances", b"", 400,
     "stage_id", None),
    ("pool-stage-missing", "GET", "/v1/pipelines/tiny-omni/stages/9/instances", b"", 400,
     "stage_id", 9),
    ("pool-all-bad", "GET", "/v1/pipelines/tiny-omni/stages/0/instances?all=maybe", b"", 400,
     "all", None),
    ("watch-no-pipeline", "GET", "/v1/watch", b"", 400, "pipeline", None),
    ("watch-unknown-pipeline", "GET", "/v1/watch?pipeline=nope", b"", 400, "pipeline", None),
    ("watch-since-bad", "GET", "/v1/watch?pipeline=tiny-omni&since=abc", b"", 400, "since", None),
    ("watch-timeout-negative", "GET", "/v1/watch?pipeline=tiny-omni&timeout_s=-1", b"", 400,
     "timeout_s", None),
    ("watch-timeout-huge", "GET", "/v1/watch?pipeline=tiny-omni&timeout_s=1e9", b"", 400,
     "timeout_s", None),
    ("watch-timeout-nan", "GET", "/v1/watch?pipeline=tiny-omni&timeout_s=nan", b"", 400,
     "timeout_s", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "payload", "status", "field", "stage"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS],
)
async def test_bad_input_is_a_4xx_naming_the_field(
    fast_client: ControlPlaneClient,
    session: aiohttp.ClientSession,
    method: str,
    path: str,
    payload: bytes,
    status: int,
    field: str,
    stage: int | None,
) -> None:
    if "{id}" in path:
        registration = await fast_client.register(reg(pipeline="synthetic", stage_id=0))
        path = path.replace("{id}", registration.instance_id)
    headers = {"Content-Type": "application/json"}
    async with session.request(method, path, data=payload or None, headers=headers) as resp:
        answer = await resp.json()
        assert resp.status == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's shape, as the sidecars
    assert (error["param"], error["code"]) == (field, status)
    assert field.split(".")[0] in error["message"] or field == "instance_id"
    if stage is not None:
        assert f"stage {stage}" in error["message"]


async def test_unknown_route_and_method_are_json_errors(session: aiohttp.ClientSession) -> None:
    async with session.get("/v1/nothing") as resp:
        assert resp.status == 404
        assert "no route" in (await resp.json())["error"]["message"]
    async with session.get("/v1/instances") as resp:
        assert resp.status == 405
        assert "not allowed" in (await resp.json())["error"]["message"]


# ---- bodies that cannot be read: a 400 naming the body, never a 500 -------------------------

_VALID_BODY = json.dumps(GOOD).encode()


async def _raw_exchange(url: str, request: bytes, *, half_close: bool = False) -> bytes:
    """Send raw bytes, read until the server closes (or 5 s pass)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        if half_close:
            writer.write_eof()
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()


def _parse_raw(answer: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


_POST = b"POST /v1/instances HTTP/1.1\r\nHost: cp\r\nContent-Type: application/json\r\n"
_GZIP_TRUNCATED = gzip.compress(_VALID_BODY)[:20]

UNREADABLE_BODIES = [
    # (id, headers and body after the request line, whether the stream is broken)
    ("gzip-garbage", b"Content-Encoding: gzip\r\nContent-Length: 4\r\n\r\nxxxx", True),
    ("gzip-garbage-chunked",
     b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nxxxx\r\n0\r\n\r\n",
     True),
    ("deflate-garbage", b"Content-Encoding: deflate\r\nContent-Length: 6\r\n\r\nnot-z!", True),
    # a gzip stream cut short decodes to a prefix of the JSON: a plain bad-JSON 400
    ("gzip-truncated", b"Content-Encoding: gzip\r\nConnection: close\r\nContent-Length: %d\r\n"
     b"\r\n%s" % (len(_GZIP_TRUNCATED), _GZIP_TRUNCATED), False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("request_tail", "broken"),
    [pytest.param(tail, broken, id=name) for name, tail, broken in UNREADABLE_BODIES],
)
async def test_an_unreadable_body_is_a_400_naming_the_body(
    fast_cp: ControlPlaneProcess, request_tail: bytes, broken: bool
) -> None:
    log_before = len(fast_cp.proc.stderr)
    # after a broken body the connection closes: what follows is not read as a request
    pipelined = b"GET /healthz HTTP/1.1\r\nHost: cp\r\n\r\n" if broken else b""
    answer = await _raw_exchange(fast_cp.url, _POST + request_tail + pipelined)
    assert answer.count(b"HTTP/1.1 ") == 1, answer
    status, headers, body = _parse_raw(answer)
    assert status == 400, answer
    assert headers["content-type"].startswith("application/json")
    assert headers["connection"].lower() == "close"
    error = body["error"]
    assert isinstance(error, dict) and error["param"] == "body", body
    assert "body" in str(error["message"])
    if broken:
        assert "request body could not be read" in str(error["message"])
    await asyncio.sleep(0.1)
    new_log = fast_cp.proc.stderr[log_before:]
    assert "Traceback" not in new_log and "Error handling request" not in new_log, new_log


async def test_curl_gzip_garbage_is_a_400(session: aiohttp.ClientSession) -> None:
    """``curl -H 'Content-Encoding: gzip' -d xxxx .../v1/instances`` (it was a 500)."""
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/x-www-form-urlencoded"}
    async with session.post("/v1/instances", data=b"xxxx", headers=headers) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error == {
        "message": "request body could not be read: Can not decode content-encoding: gzip",
        "type": "invalid_request_error",
        "param": "body",
        "code": 400,
    }


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_a_body_cut_short_by_the_client_is_no_server_error(
    fast_cp: ControlPlaneProcess, session: aiohttp.ClientSession, framing: str
) -> None:
    log_before = len(fast_cp.proc.stderr)
    if framing == "chunked":
        request = _POST + b'Transfer-Encoding: chunked\r\n\r\n20\r\n{"pipeline": "tin'
    else:
        request = _POST + b'Content-Length: 100\r\n\r\n{"pipeline": "tin'
    # the client half-closes mid-body: aiohttp drops the connection, nobody gets an answer
    assert await _raw_exchange(fast_cp.url, request, half_close=True) == b""
    async with session.get("/healthz") as resp:
        assert resp.status == 200
    await asyncio.sleep(0.2)
    new_log = fast_cp.proc.stderr[log_before:]
    assert "Traceback" not in new_log and "Error handling request" not in new_log, new_log
