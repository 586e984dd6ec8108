"""A session's persister against a real omni-cp and its Redis: whatever changed the
conversation and however the writes coalesce, the store accepts them and holds the
conversation the socket holds (the store refuses an order that names an item it does not
hold, and one that leaves out an item it holds)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.client import ControlPlaneClient
from omni_mesh.sidecar.api.realtime.config import default_config
from omni_mesh.sidecar.api.realtime.conversation import Conversation, Item, Part, new_id
from omni_mesh.sidecar.api.realtime.cp_store import ControlPlaneSessionStore
from omni_mesh.sidecar.api.realtime.persist import SessionPersister
from tests.procs import ControlPlaneProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PIPELINE = "tiny-omni"


@pytest.fixture
async def store(control_plane: ControlPlaneProcess) -> AsyncIterator[ControlPlaneSessionStore]:
    client = ControlPlaneClient([control_plane.url], timeout_s=5.0)
    yield ControlPlaneSessionStore(client)
    await client.close()


def a_session(conversation: Conversation | None = None) -> Any:
    pipeline = get_pipeline(PIPELINE)
    return SimpleNamespace(
        id=new_id("sess"),
        pod=SimpleNamespace(pipeline=pipeline),
        config=default_config(pipeline),
        conversation=conversation or Conversation(),
    )


def text_item(role: str, text: str) -> Item:
    kind = "input_text" if role == "user" else "output_text"
    return Item(id=new_id("item"), role=role, parts=[Part(type=kind, text=text)])


def persister(store: ControlPlaneSessionStore, session: Any, epoch: int = 0) -> SessionPersister:
    fenced: list[bool] = []
    p = SessionPersister(
        store, session, "api-1", epoch=epoch, ttl_s=60.0, on_fenced=lambda: fenced.append(True)
    )
    p.start(create=epoch == 0)
    return p


async def settled(p: SessionPersister) -> None:
    for _ in range(200):
        if not p.pending:
            await asyncio.sleep(0.05)  # a write in flight clears pending before it lands
            if not p.pending:
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the persister never settled")


async def stored_ids(store: ControlPlaneSessionStore, session_id: str) -> list[str]:
    claimed = await store.claim(session_id, "api-2")
    assert claimed is not None
    return claimed.conversation.ids()


async def test_an_item_added_without_a_change_of_its_own_is_written_with_the_order(
    store: ControlPlaneSessionStore,
) -> None:
    """A response's item enters the conversation as it begins; a write of anything else
    (here the config) sends the order, which names it: it goes with it, not refused."""
    session = a_session()
    p = persister(store, session)
    user = text_item("user", "remember the word kettle")
    session.conversation.add(user)
    p.changed(items=[user.id], deleted=[])
    await settled(p)
    assistant = text_item("assistant", "")
    session.conversation.add(assistant)  # as ResponseRun._begin does
    p.changed(items=[], deleted=[])  # a session.update meanwhile
    await settled(p)
    assert not p.fenced and p.failures == 0
    assistant.parts[0].text = "kettle"
    p.changed(items=[assistant.id], deleted=[])  # the response ended
    await p.close()
    assert await stored_ids(store, session.id) == [user.id, assistant.id]
    claimed = await store.claim(session.id, "api-3")
    assert claimed is not None and claimed.conversation.items[1].parts[0].text == "kettle"


async def test_an_item_dropped_from_a_full_conversation_is_deleted_with_the_order(
    store: ControlPlaneSessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_mesh.sidecar.api.realtime import conversation

    monkeypatch.setattr(conversation, "MAX_ITEMS", 3)
    session = a_session()
    p = persister(store, session)
    items = [text_item("user", f"turn {n}") for n in range(3)]
    for item in items:
        session.conversation.add(item)
        p.changed(items=[item.id], deleted=[])
    await settled(p)
    late = text_item("assistant", "")
    dropped = session.conversation.add(late)  # the oldest leaves: no deletion said
    assert [d.id for d in dropped] == [items[0].id]
    p.changed(items=[], deleted=[])
    await p.close()
    assert not p.fenced and p.failures == 0
    assert await stored_ids(store, session.id) == [items[1].id, items[2].id, late.id]


async def test_a_claimed_session_writes_only_what_changed(
    store: ControlPlaneSessionStore,
) -> None:
    first = a_session()
    p = persister(store, first)
    old = text_item("user", "hello")
    first.conversation.add(old)
    p.changed(items=[old.id], deleted=[])
    await p.close()
    claimed = await store.claim(first.id, "api-1")
    assert claimed is not None
    resumed = a_session(claimed.conversation)
    resumed.id = first.id
    puts: list[list[str]] = []
    real_patch = store.patch

    async def patch(session_id: str, epoch: int, **kw: Any) -> None:
        puts.append(sorted(kw["put_items"]))
        await real_patch(session_id, epoch, **kw)

    store.patch = patch  # type: ignore[method-assign]
    q = persister(store, resumed, epoch=claimed.epoch)
    new = text_item("assistant", "hi")
    resumed.conversation.add(new)
    q.changed(items=[], deleted=[])
    await q.close()
    assert puts == [[new.id]]  # the loaded item is not written again
    assert await stored_ids(store, first.id) == [old.id, new.id]


async def test_a_malformed_stored_item_is_deleted_not_a_refused_write(
    store: ControlPlaneSessionStore,
) -> None:
    """An item the claim cannot read is left out of the conversation; the store still holds
    it, so the next order deletes it (an order without it alone would be refused)."""
    first = a_session()
    p = persister(store, first)
    good = text_item("user", "hello")
    first.conversation.add(good)
    p.changed(items=[good.id], deleted=[])
    await p.close()
    claimed = await store.claim(first.id, "api-1")
    assert claimed is not None
    await store.patch(
        first.id,
        claimed.epoch,
        config=None,
        put_items={"item_bad": {"role": 7}},
        delete_items=[],
        order=[good.id, "item_bad"],
    )
    again = await store.claim(first.id, "api-1")
    assert again is not None and again.conversation.ids() == [good.id]
    assert again.item_ids == [good.id, "item_bad"]
    resumed = a_session(again.conversation)
    resumed.id = first.id
    fenced: list[bool] = []
    q = SessionPersister(
        store,
        resumed,
        "api-1",
        epoch=again.epoch,
        ttl_s=60.0,
        on_fenced=lambda: fenced.append(True),
    )
    q.start(create=False, stored_ids=again.item_ids)
    new = text_item("assistant", "hi")
    resumed.conversation.add(new)
    q.changed(items=[], deleted=[])
    await q.close()
    assert not q.fenced and q.failures == 0 and not fenced
    assert await stored_ids(store, first.id) == [good.id, new.id]
