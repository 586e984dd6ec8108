"""A resume waits for the socket that held the session to release it (it may still be writing
the session's last changes), but not for a holder that never lets go. The far side (the
store's holder) is faked; the waiting is the route's own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from omni_mesh.sidecar.api.realtime import route

pytestmark = pytest.mark.unit


class Store:
    def __init__(self, holders: list[str | None]) -> None:
        self.holders = holders
        self.asked = 0

    async def holder(self, session_id: str) -> str | None:
        self.asked += 1
        return self.holders.pop(0) if len(self.holders) > 1 else self.holders[0]


class Hub:
    def __init__(self) -> None:
        self.persisters: dict[str, Any] = {}


def handover(hub: Hub, store: Store, owner: str = "api-2") -> float:
    t0 = time.monotonic()
    asyncio.run(route._handover(hub, store, "sess_1", owner))  # type: ignore[arg-type]
    return time.monotonic() - t0


def test_the_resume_waits_until_the_other_server_releases() -> None:
    store = Store(["api-1", "api-1", "api-1", ""])
    assert handover(Hub(), store) < route.HANDOVER_WAIT_S
    assert store.asked == 4


def test_a_released_unknown_or_own_session_is_taken_at_once() -> None:
    for holder in ("", None, "api-2"):
        store = Store([holder])
        assert handover(Hub(), store) < route.HANDOVER_POLL_S
        assert store.asked == 1


def test_a_holder_that_never_lets_go_is_waited_for_a_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(route, "HANDOVER_WAIT_S", 0.3)
    waited = handover(Hub(), Store(["api-1"]))
    assert 0.3 <= waited < 1.5


def test_a_socket_closing_on_this_server_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    hub, store = Hub(), Store([""])
    hub.persisters["sess_1"] = object()

    async def close_soon() -> float:
        async def closes() -> None:
            await asyncio.sleep(0.2)
            del hub.persisters["sess_1"]

        task = asyncio.create_task(closes())
        t0 = time.monotonic()
        await route._handover(hub, store, "sess_1", "api-2")  # type: ignore[arg-type]
        await task
        return time.monotonic() - t0

    assert 0.2 <= asyncio.run(close_soon()) < route.HANDOVER_WAIT_S
    assert store.asked == 1  # asked once it had closed here
