"""Move a payload's tensors into shared-memory slots (:func:`externalize`) and back out as
zero-copy views (:func:`inline`)."""

from __future__ import annotations

from omni_mesh.data_plane.messages import Payload, Tensor
from omni_mesh.data_plane.shm_arena import ShmArena, ShmSlot
from omni_mesh.data_plane.shm_reader import ShmReader


def externalize(
    payload: Payload, arena: ShmArena, owner: str, *, threshold: int = 64 << 10
) -> Payload:
    """A copy of ``payload`` whose inline tensors of ``threshold`` bytes or more live in slots
    of ``arena`` held for ``owner`` (one memcpy each). Smaller tensors stay inline."""
    tensors: dict[str, Tensor] = {}
    slots: list[ShmSlot] = []
    try:
        for name, t in payload.tensors.items():
            if t.data is None or t.data.nbytes < threshold:
                tensors[name] = t
                continue
            slot = arena.alloc(t.data.nbytes, owner)
            slots.append(slot)
            data = t.data if t.data.format == "B" and t.data.ndim == 1 else t.data.cast("B")
            slot.view[:] = data
            tensors[name] = Tensor(dtype=t.dtype, shape=t.shape, shm=slot.ref)
    except BaseException:
        for slot in slots:
            arena.free(slot)
        raise
    return Payload(fields=payload.fields, tensors=tensors)


def inline(payload: Payload, reader: ShmReader) -> Payload:
    """A copy of ``payload`` whose shared-memory tensors are zero-copy views of their mapped
    slots; the encoder then copies them once into the outgoing message."""
    if all(t.shm is None for t in payload.tensors.values()):
        return payload
    tensors = {
        name: t if t.shm is None else Tensor(dtype=t.dtype, shape=t.shape, data=reader.view(t.shm))
        for name, t in payload.tensors.items()
    }
    return Payload(fields=payload.fields, tensors=tensors)
