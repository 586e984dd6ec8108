"""Scripted hop answers for the streaming-answer tests: the far side of the hop client, faked
(the routes' sinks and response handling under test are real)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from omni_mesh.data_plane.messages import HopResult

Item = HopResult | BaseException


class Script:
    """Scripted answer frames, one item per ``delay_s``; an exception item is raised; records
    whether the consumer closed the iterator."""

    def __init__(self, items: Sequence[Item], delay_s: float = 0.03, hang: bool = False) -> None:
        self.items = list(items)
        self.delay_s = delay_s
        self.hang = hang
        self.closed = asyncio.Event()

    async def frames(self) -> AsyncGenerator[HopResult, None]:
        try:
            for item in self.items:
                await asyncio.sleep(self.delay_s)
                if isinstance(item, BaseException):
                    raise item
                yield item
            if self.hang:
                await asyncio.Event().wait()
        finally:
            self.closed.set()
