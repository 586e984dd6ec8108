"""Test helpers for the hop client."""

from __future__ import annotations

from omni_mesh.data_plane.messages import HopResult, StageInput
from omni_mesh.sidecar.hop.client import HopClient


async def send(client: HopClient, si: StageInput) -> HopResult:
    """Hand ``si`` to a replica whose answer is one frame (nothing downstream streams)."""
    frames = [frame async for frame in client.stream(si)]
    if len(frames) != 1:
        raise RuntimeError(f"the answer to {si.request_id} streamed; use stream()")
    return frames[0]
