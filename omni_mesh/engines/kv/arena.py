"""Where a split stage's transformers engine keeps KV for NIXL: one byte buffer, registered
with the engine's NIXL agent once (a remote agent learns its registrations from the agent's
metadata, so memory registered later would need fresh metadata at every peer), carved into
slots by :class:`SlotAllocator`."""

from __future__ import annotations

import bisect

#: Slots start on this boundary (a cache line; every dtype's alignment).
ALIGN = 64


class SlotAllocator:
    """First-fit slots of a buffer of ``capacity`` bytes: ``take(n)`` gives an offset, or None
    when no free run is long enough; ``give(offset)`` frees the slot starting there."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, length), by offset
        self._taken: dict[int, int] = {}  # offset -> length

    @property
    def used(self) -> int:
        return sum(self._taken.values())

    def take(self, nbytes: int) -> int | None:
        length = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (offset, free) in enumerate(self._free):
            if free >= length:
                if free == length:
                    self._free.pop(i)
                else:
                    self._free[i] = (offset + length, free - length)
                self._taken[offset] = length
                return offset
        return None

    def give(self, offset: int) -> None:
        length = self._taken.pop(offset)  # KeyError: not a slot of this allocator
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, length))
        # merge with the next, then the previous free run
        if i + 1 < len(self._free) and offset + length == self._free[i + 1][0]:
            self._free[i] = (offset, length + self._free.pop(i + 1)[1])
        if i > 0:
            before, before_len = self._free[i - 1]
            if before + before_len == offset:
                self._free[i - 1] = (before, before_len + self._free.pop(i)[1])
