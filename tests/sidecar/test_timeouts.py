"""``within``: a short timeout that does not blame a live peer for this loop's own lateness."""

from __future__ import annotations

import asyncio
import time

import pytest

from omni_mesh.sidecar.hop.liveness import probe
from omni_mesh.sidecar.hop.timeouts import within


async def _server() -> asyncio.Server:
    async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return  # a bare connect, closed without a request
        finally:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            writer.close()

    return await asyncio.start_server(health, "127.0.0.1", 0)


def _stall_loop(seconds: float) -> None:
    """Block this event loop, as a saturated host's scheduler would."""
    asyncio.get_running_loop().call_soon(time.sleep, seconds)


async def test_a_late_loop_does_not_fail_a_live_peer() -> None:
    server = await _server()
    try:
        port = server.sockets[0].getsockname()[1]
        for _ in range(3):
            _stall_loop(0.4)  # far longer than the 0.1 s windows below
            _reader, writer = await within(asyncio.open_connection("127.0.0.1", port), 0.1)
            writer.close()
            _stall_loop(0.4)
            assert await probe("127.0.0.1", port, connect_timeout_s=0.1, answer_timeout_s=0.1) == ""
    finally:
        server.close()
        await server.wait_closed()


async def test_a_loop_that_keeps_time_still_times_out_promptly() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await within(never, 0.1)
    assert time.monotonic() - t0 < 1.0
    assert never.cancelled()


async def test_only_a_bounded_number_of_late_windows() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def stall_each_window() -> None:
        while True:
            await asyncio.sleep(0)
            time.sleep(0.12)  # noqa: ASYNC251 (every window of 0.05 s ends late)

    staller = asyncio.create_task(stall_each_window())
    try:
        with pytest.raises(TimeoutError):
            await within(never, 0.05, max_windows=3)
    finally:
        staller.cancel()
    assert never.cancelled()


async def test_the_awaited_result_and_errors_pass_through() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 7

    assert await within(answer(), 1.0) == 7

    async def refuse() -> None:
        raise ConnectionRefusedError("no")

    with pytest.raises(ConnectionRefusedError):
        await within(refuse(), 1.0)
