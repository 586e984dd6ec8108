"""The slots of a split stage's KV buffers (``engines/kv/arena.py``): first fit, aligned,
freed runs merged with their neighbours, None when no run is long enough."""

from __future__ import annotations

import pytest

from omni_mesh.engines.kv.arena import ALIGN, SlotAllocator

pytestmark = pytest.mark.unit


def test_slots_are_aligned_and_first_fit() -> None:
    slots = SlotAllocator(10 * ALIGN)
    a, b, c = slots.take(1), slots.take(ALIGN + 1), slots.take(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert slots.used == 4 * ALIGN
    slots.give(b)
    assert slots.take(ALIGN) == ALIGN  # the first free run that fits
    assert slots.take(2 * ALIGN) == 4 * ALIGN  # the hole left is one ALIGN: too short


def test_freed_neighbours_merge_into_one_run() -> None:
    slots = SlotAllocator(4 * ALIGN)
    offsets = [slots.take(ALIGN) for _ in range(4)]
    assert slots.take(1) is None  # full
    for offset in (offsets[1], offsets[3], offsets[2]):  # middle, end, then the one between
        slots.give(offset)  # type: ignore[arg-type]
    assert slots.take(3 * ALIGN) == ALIGN  # one run again
    slots.give(ALIGN)
    slots.give(0)
    assert slots.used == 0 and slots.take(4 * ALIGN) == 0


def test_a_slot_is_freed_once() -> None:
    slots = SlotAllocator(ALIGN)
    offset = slots.take(8)
    assert offset is not None
    slots.give(offset)
    with pytest.raises(KeyError):
        slots.give(offset)
    with pytest.raises(ValueError, match="capacity"):
        SlotAllocator(0)
