"""Prefill/decode split of a stage: what the fabric carries for a KV hand-off.

A split stage has two pools (deploy ``prefill:``), told apart by the label ``KV_ROLE_LABEL``
of their registrations (``control_plane/schema.py``). The sender of a hop to a split stage
first sends the input to a prefill replica with ``StageInput.kv_transfer`` =
:data:`PREFILL_REQUEST`: its engine computes the prompt's KV cache (vLLM, one token) and
answers with one :class:`~omni_mesh.data_plane.messages.HopResult` whose ``kv_transfer`` holds
vLLM's ``kv_transfer_params`` (where the blocks are: engine id, side channel, block ids)
and nothing else: no next-stage inputs, no final output. The sender then sends the same input
to a decode replica with those params in ``kv_transfer``; that engine pulls the blocks from the
prefill engine (``NixlConnector``, engine to engine) and generates. Only the params travel
through the sidecars. ``""`` is an ordinary run (an unsplit stage, or a decode replica
prefilling itself when no prefill replica could).
"""

from __future__ import annotations

import json
from typing import Any

#: ``StageInput.kv_transfer`` of a prefill request.
PREFILL_REQUEST = '{"do_remote_decode":true}'
#: Longest params text accepted from a prefill answer (its block ids: ~6 bytes per 16 tokens).
MAX_PARAMS_BYTES = 1 << 20


class KvTransferError(ValueError):
    """``kv_transfer`` is not a prefill request nor the params of a prefill answer."""


def is_prefill(kv_transfer: str) -> bool:
    return kv_transfer == PREFILL_REQUEST


def decode_params(kv_transfer: str) -> dict[str, Any]:
    """The params of a prefill answer as a decode request hands them to vLLM; raises
    :class:`KvTransferError` naming what is wrong."""
    if len(kv_transfer) > MAX_PARAMS_BYTES:
        raise KvTransferError(f"kv_transfer: longer than {MAX_PARAMS_BYTES} bytes")
    try:
        params = json.loads(kv_transfer)
    except ValueError as exc:
        raise KvTransferError(f"kv_transfer: not JSON ({exc})") from None
    if not isinstance(params, dict) or not params.get("remote_engine_id"):
        raise KvTransferError("kv_transfer: not a prefill answer's params (no remote_engine_id)")
    return {**params, "do_remote_prefill": True, "do_remote_decode": False}


def prefill_params() -> dict[str, Any]:
    """vLLM's ``kv_transfer_params`` of a prefill request: keep the blocks for a remote
    decode (a pull: the decode engine reads them)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
