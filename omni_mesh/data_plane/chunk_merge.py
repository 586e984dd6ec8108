"""The chunks of a streamed input as one whole input (``/v1/run``: a stage whose spec has
``stream_input`` gets its source's answer in one piece, as every stage does there).

The rule is the one the receiving engine applies as chunks arrive (``engines/fed.py``): arrays
of the same name are joined along their first axis, in chunk order; a later chunk's fields
replace those of the same name."""

from __future__ import annotations

import msgspec
import numpy as np

from omni_mesh.data_plane.messages import Payload, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array


def merged_input(chunks: list[StageInput], reader: ShmReader) -> StageInput:
    """One whole input (chunk 0, ``last``) from ``chunks``, in order; tensors inline.
    ValueError for an array whose dtype or trailing shape changes between chunks."""
    fields: dict[str, object] = {}
    parts: dict[str, list[np.ndarray]] = {}
    for si in chunks:
        fields.update(si.payload.fields)
        for name, t in si.payload.tensors.items():
            parts.setdefault(name, []).append(array_from_tensor(t, reader))
    tensors = {}
    for name, arrays in parts.items():
        first = arrays[0]
        for arr in arrays[1:]:
            if (
                arr.dtype != first.dtype
                or arr.ndim == 0
                or first.ndim == 0
                or arr.shape[1:] != first.shape[1:]
            ):
                raise ValueError(
                    f"streamed input: array {name!r} is {arr.dtype}{list(arr.shape)} in a later "
                    f"chunk, {first.dtype}{list(first.shape)} in the first"
                )
        whole = np.concatenate(arrays) if len(arrays) > 1 else first.copy()
        tensors[name] = tensor_from_array(np.ascontiguousarray(whole))
    payload = Payload(fields=dict(fields), tensors=tensors)  # type: ignore[arg-type]
    return msgspec.structs.replace(chunks[0], chunk=0, last=True, stream_from="", payload=payload)
