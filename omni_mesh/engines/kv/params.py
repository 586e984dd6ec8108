"""The params of a transformers prefill's held state (``exchange.py``): the JSON a prefill
answer carries and a decode engine reads. A slot's layout: its tensors one after another, each
on an :data:`ALIGN` boundary, the first a 16-byte tag naming the hold."""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from omni_mesh.data_plane.kv_transfer import KvTransferError
from omni_mesh.engines.kv.arena import ALIGN

TAG = "tag"  # the slot's first tensor: 16 bytes naming the hold
PULLED = b"pulled:"  # a read's notification to the prefill engine: PULLED + hold id
DTYPES = {
    name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "int64", "uint8")
}
#: The params' format (``"v"``): a decode engine refuses another (a rolling upgrade).
PARAMS_VERSION = 1
#: Longest params text a pull accepts (a layout per layer: ~100 bytes each).
MAX_PARAMS_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor in a slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the slot's start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * int(DTYPES[self.dtype].itemsize)


def layout(tensors: dict[str, Tensor]) -> tuple[list[Entry], int]:
    entries, offset = [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise KvTransferError(f"cannot hold {name}: dtype {dtype}")
        entry = Entry(name, dtype, tuple(int(n) for n in t.shape), offset)
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return entries, offset


def parse(text: str) -> tuple[str, bytes, str, int, list[Entry], int]:
    """(remote agent, its metadata, hold id, address, entries, bytes) of a prefill answer's
    params; :class:`KvTransferError` naming what is wrong."""
    if len(text) > MAX_PARAMS_BYTES:
        raise KvTransferError(f"kv_transfer: longer than {MAX_PARAMS_BYTES} bytes")
    try:
        p = json.loads(text)
        if p.get("v") != PARAMS_VERSION:
            raise ValueError(f"params version {p.get('v')!r}, this engine reads {PARAMS_VERSION}")
        remote, hold_id = str(p["remote_engine_id"]), str(p["hold"])
        metadata = base64.b64decode(p["agent"], validate=True)
        addr, nbytes = int(p["addr"]), int(p["nbytes"])
        entries = [
            Entry(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in p["tensors"]
        ]
        if len(bytes.fromhex(hold_id)) != 16:
            raise ValueError("hold is not 16 bytes")
    except Exception as exc:  # any shape of bad JSON: not a prefill's params
        raise KvTransferError(
            f"kv_transfer: not a transformers prefill's params ({type(exc).__name__}: {exc})"
        ) from None
    if not remote or addr < 0 or nbytes <= 0 or not entries:
        raise KvTransferError("kv_transfer: not a transformers prefill's params")
    if (entries[0].name, entries[0].dtype, entries[0].shape) != (TAG, "uint8", (16,)):
        raise KvTransferError("kv_transfer: the slot does not start with its tag")
    for e in entries:
        if e.dtype not in DTYPES or any(n < 0 for n in e.shape):
            raise KvTransferError(f"kv_transfer: tensor {e.name!r}: bad dtype or shape")
        if e.offset < 0 or e.offset % ALIGN or e.offset + e.nbytes > nbytes:
            raise KvTransferError(f"kv_transfer: tensor {e.name!r} lies outside the slot")
    return remote, metadata, hold_id, addr, entries, nbytes
