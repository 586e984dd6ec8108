"""Test helpers for the hop client."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from omni_mesh.data_plane.messages import HopResult, StageInput
from omni_mesh.sidecar.hop.client import HOP_PATH, HopClient

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def send(client: HopClient, si: StageInput) -> HopResult:
    """Hand ``si`` to a replica whose answer is one frame (nothing downstream streams)."""
    frames = [frame async for frame in client.stream(si)]
    if len(frames) != 1:
        raise RuntimeError(f"the answer to {si.request_id} streamed; use stream()")
    return frames[0]


async def serve_hops(handler: Handler) -> tuple[web.AppRunner, int]:
    """A loopback aiohttp server answering ``POST /v1/hop`` with ``handler``: its runner
    (``cleanup()`` it) and port."""
    app = web.Application()
    app.router.add_post(HOP_PATH, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]
