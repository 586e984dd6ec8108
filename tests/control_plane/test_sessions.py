"""Realtime sessions as control-plane state: a real ``omni-cp`` on the session Redis, driven
through :class:`SessionsClient` (and raw HTTP for the error shapes)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from pydantic import JsonValue

from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    ControlPlaneRequestError,
    SessionFenced,
    SessionNotFound,
    SessionsClient,
)
from omni_mesh.control_plane.session_schema import (
    MAX_SESSION_ITEMS,
    MAX_TOUCH_IDS,
    OWNED_TTL_MS,
)
from tests.procs import ControlPlaneProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NewId = Callable[[], str]


@pytest.fixture
async def sessions(fast_client: ControlPlaneClient) -> AsyncIterator[SessionsClient]:
    yield SessionsClient(fast_client)


@pytest.fixture
async def new_id(sessions: SessionsClient) -> AsyncIterator[NewId]:
    """Fresh session ids, deleted after the test (the Redis is shared by the module)."""
    made: list[str] = []

    def make() -> str:
        made.append(f"sess_{uuid.uuid4().hex[:12]}")
        return made[-1]

    yield make
    for session_id in made:
        with contextlib.suppress(SessionNotFound):
            await sessions.delete(session_id)


@pytest.fixture
async def http(fast_cp: ControlPlaneProcess) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=fast_cp.url) as s:
        yield s


async def test_claim_fences_the_old_owner(sessions: SessionsClient, new_id: NewId) -> None:
    sid = new_id()
    created = await sessions.create(sid, "tiny-omni", "api-a", {"voice": "alloy"})
    assert (created.epoch, created.owner, created.item_count) == (1, "api-a", 0)
    await sessions.patch(sid, 1, put_items={"i1": {"role": "user", "text": "hi"}})

    state = await sessions.claim(sid, "api-b")
    assert (state.epoch, state.owner, state.config) == (2, "api-b", {"voice": "alloy"})
    assert [(i.id, i.item) for i in state.items] == [("i1", {"role": "user", "text": "hi"})]

    with pytest.raises(SessionFenced) as fenced:
        await sessions.patch(sid, 1, put_items={"i2": {"role": "assistant"}})
    assert fenced.value.status == 409 and fenced.value.field == "epoch"
    assert "epoch 2" in fenced.value.message and "api-b" in fenced.value.message
    with pytest.raises(SessionFenced):
        await sessions.release(sid, 1)
    touched = await sessions.touch("api-a", [sid])
    assert touched.lost == (sid,) and touched.renewed == ()

    after = await sessions.patch(sid, 2, config={"voice": "echo"})
    assert after.epoch == 2 and after.item_count == 1
    assert (await sessions.get(sid)).config == {"voice": "echo"}


async def test_items_survive_claims_in_order(sessions: SessionsClient, new_id: NewId) -> None:
    sid = new_id()
    await sessions.create(sid, "tiny-omni", "api-a")
    items: dict[str, dict[str, JsonValue]] = {
        "a": {"role": "user", "parts": [{"type": "input_text", "text": "héllo"}]},
        "b": {"role": "assistant", "audio_ms": 1200, "status": None},
        "c": {"role": "user", "nested": {"x": [1, 2.5, True, None]}},
    }
    await sessions.patch(sid, 1, put_items=items)
    await sessions.patch(sid, 1, put_items={"d": {"role": "system"}}, delete_items=["b"])
    first = await sessions.claim(sid, "api-b")
    assert [i.id for i in first.items] == ["a", "c", "d"]
    assert [i.item for i in first.items] == [items["a"], items["c"], {"role": "system"}]

    reordered = await sessions.patch(
        sid, 2, put_items={"a": {"role": "user", "text": "edited"}}, order=["d", "a", "c"]
    )
    assert reordered.item_count == 3
    second = await sessions.claim(sid, "api-c")
    assert second.epoch == 3
    assert [(i.id, i.item) for i in second.items] == [
        ("d", {"role": "system"}),
        ("a", {"role": "user", "text": "edited"}),
        ("c", items["c"]),
    ]
    assert (await sessions.get(sid)).items == second.items


async def test_release_then_expiry(sessions: SessionsClient, new_id: NewId) -> None:
    sid = new_id()
    await sessions.create(sid, "tiny-omni", "api-a")
    await sessions.patch(sid, 1, put_items={"i1": {"text": "kept"}})
    released = await sessions.release(sid, 1, ttl_ms=600)
    assert released.owner == "" and 0 < released.ttl_ms <= 600
    with pytest.raises(SessionFenced, match="released"):
        await sessions.patch(sid, 1, put_items={"i2": {}})
    assert (await sessions.touch("api-a", [sid])).lost == (sid,)
    state = await sessions.get(sid)
    assert state.owner == "" and [i.item for i in state.items] == [{"text": "kept"}]

    await asyncio.sleep(0.8)
    with pytest.raises(SessionNotFound):
        await sessions.get(sid)
    with pytest.raises(SessionNotFound):
        await sessions.claim(sid, "api-b")


async def test_released_session_is_resumed_by_a_claim(
    sessions: SessionsClient, new_id: NewId
) -> None:
    sid = new_id()
    await sessions.create(sid, "tiny-omni", "api-a")
    await sessions.release(sid, 1)
    state = await sessions.claim(sid, "api-b")
    assert (state.epoch, state.owner) == (2, "api-b")
    assert state.ttl_ms == OWNED_TTL_MS


async def test_touch_renews_owned_sessions(sessions: SessionsClient, new_id: NewId) -> None:
    mine, theirs = new_id(), new_id()
    await sessions.create(mine, "tiny-omni", "api-a")
    await sessions.create(theirs, "tiny-omni", "api-b")
    await asyncio.sleep(0.5)
    assert (await sessions.get(mine)).ttl_ms <= OWNED_TTL_MS - 400
    touched = await sessions.touch("api-a", [mine, theirs, "sess_never_was"])
    assert touched.renewed == (mine,)
    assert touched.lost == (theirs, "sess_never_was")
    assert (await sessions.get(mine)).ttl_ms > OWNED_TTL_MS - 300
    assert (await sessions.get(theirs)).ttl_ms <= OWNED_TTL_MS - 400, "not renewed"


async def test_touch_of_many_sessions(sessions: SessionsClient, new_id: NewId) -> None:
    sid = new_id()
    await sessions.create(sid, "tiny-omni", "api-a")
    others = [f"sess_gone_{n:05d}_{'x' * 100}" for n in range(MAX_TOUCH_IDS + 10)]
    touched = await sessions.touch("api-a", [*others, sid])
    assert touched.renewed == (sid,) and touched.lost == tuple(others)


async def test_size_and_item_limits_are_413(sessions: SessionsClient, new_id: NewId) -> None:
    sid = new_id()
    await sessions.create(sid, "tiny-omni", "api-a")
    blob = "x" * (3 * 1024 * 1024)
    await sessions.patch(sid, 1, put_items={"a1": {"audio": blob}})
    await sessions.patch(sid, 1, put_items={"a2": {"audio": blob}})
    with pytest.raises(ControlPlaneRequestError) as too_big:
        await sessions.patch(sid, 1, put_items={"a3": {"audio": blob}})
    assert too_big.value.status == 413 and too_big.value.field == "put_items"
    assert "limit is 8388608" in too_big.value.message
    replaced = await sessions.patch(sid, 1, put_items={"a2": {"audio": "small"}})
    assert replaced.size_bytes < 4 * 1024 * 1024, "a replaced item frees its bytes"
    with pytest.raises(ControlPlaneRequestError) as body:
        await sessions.patch(sid, 1, put_items={"huge": {"audio": blob * 3}})
    assert body.value.status == 413 and body.value.field == "body"

    many = new_id()
    await sessions.create(many, "tiny-omni", "api-a")
    await sessions.patch(many, 1, put_items={f"i{n}": {} for n in range(MAX_SESSION_ITEMS - 4)})
    with pytest.raises(ControlPlaneRequestError) as too_many:
        await sessions.patch(many, 1, put_items={f"j{n}": {} for n in range(5)})
    assert too_many.value.status == 413 and "1024" in too_many.value.message
    assert (await sessions.get(many)).item_count == MAX_SESSION_ITEMS - 4, "nothing applied"


async def test_bad_order_is_400_naming_order(sessions: SessionsClient, new_id: NewId) -> None:
    sid = new_id()
    await sessions.create(sid, "tiny-omni", "api-a")
    await sessions.patch(sid, 1, put_items={"a": {}, "b": {}})
    with pytest.raises(ControlPlaneRequestError) as unknown:
        await sessions.patch(sid, 1, order=["a", "b", "zzz"])
    assert unknown.value.status == 400 and unknown.value.field == "order"
    assert "'zzz' is not an item" in unknown.value.message
    with pytest.raises(ControlPlaneRequestError) as missing:
        await sessions.patch(sid, 1, put_items={"c": {}}, order=["c", "a"])
    assert missing.value.status == 400 and missing.value.field == "order"
    assert "'b' is missing" in missing.value.message
    state = await sessions.get(sid)
    assert [i.id for i in state.items] == ["a", "b"], "a refused patch changes nothing"


async def test_unknown_sessions_are_404(sessions: SessionsClient) -> None:
    sid = f"sess_{uuid.uuid4().hex}"
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: sessions.get(sid),
        lambda: sessions.claim(sid, "api-a"),
        lambda: sessions.patch(sid, 1, config={}),
        lambda: sessions.release(sid, 1),
        lambda: sessions.delete(sid),
        lambda: sessions.get("bad id!"),
    ]
    for call in calls:
        with pytest.raises(SessionNotFound) as exc:
            await call()
        assert exc.value.status == 404 and exc.value.field == "session_id"


async def test_error_shapes_over_http(
    http: aiohttp.ClientSession, sessions: SessionsClient, new_id: NewId
) -> None:
    sid = new_id()
    body = {"session_id": sid, "pipeline": "tiny-omni", "owner": "api-a", "config": {}}
    async with http.post("/v1/sessions", json=body) as resp:
        assert resp.status == 201
    async with http.post("/v1/sessions", json=body) as resp:
        assert resp.status == 409
        assert (await resp.json())["error"]["code"] == "session_exists"
    await sessions.claim(sid, "api-b")
    async with http.patch(f"/v1/sessions/{sid}", json={"epoch": 1, "config": {}}) as resp:
        assert resp.status == 409
        error = (await resp.json())["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "session_fenced",
            "epoch",
            "conflict",
        )
    bad_pipeline = {**body, "session_id": new_id(), "pipeline": "no-such"}
    async with http.post("/v1/sessions", json=bad_pipeline) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "pipeline"
    both = {"epoch": 2, "put_items": {"a": {}}, "delete_items": ["a"]}
    async with http.patch(f"/v1/sessions/{sid}", json=both) as resp:
        assert resp.status == 400 and "also in put_items" in (await resp.json())["error"]["message"]
    async with http.patch(f"/v1/sessions/{sid}", json={"epoch": 2, "put_items": {"a": 3}}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "put_items.a"
    async with http.get("/v1/sessions", params={"pipeline": "no-such"}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "pipeline"


async def test_counts_metrics_and_status(
    sessions: SessionsClient,
    new_id: NewId,
    http: aiohttp.ClientSession,
    fast_cp: ControlPlaneProcess,
) -> None:
    owned = [new_id(), new_id()]
    released = new_id()
    for sid in [*owned, released]:
        await sessions.create(sid, "tiny-image", "api-a")
    await sessions.release(released, 1)
    [counts] = await sessions.counts("tiny-image")
    assert (counts.owned, counts.released) == (2, 1)
    assert "tiny-image" in {c.pipeline for c in await sessions.counts()}

    async with http.get("/metrics") as resp:
        text = await resp.text()
    assert 'omni_cp_sessions{pipeline="tiny-image",state="owned"} 2.0' in text
    assert 'omni_cp_sessions{pipeline="tiny-image",state="released"} 1.0' in text

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "omni_mesh.control_plane",
        "status",
        "--cp",
        fast_cp.url,
        "--pipeline",
        "tiny-image",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert "sessions pipeline=tiny-image owned=2 released=1" in out.decode().splitlines()

    await sessions.delete(owned[0])
    [counts] = await sessions.counts("tiny-image")
    assert (counts.owned, counts.released) == (1, 1)
