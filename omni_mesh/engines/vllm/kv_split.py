"""vLLM's side of a split stage (deploy ``prefill:``): every replica, prefill or decode, runs
vLLM's ``NixlConnector`` (``kv_role: kv_both``: which role a request plays is said per request
by its ``kv_transfer_params``, see ``data_plane/kv_transfer.py``), so a decode replica can also
prefill for itself when no prefill replica can.

The connector's side channel (where a decode engine asks a prefill engine for its blocks'
layout) listens on ``VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT``. The port is a
free one picked here unless the environment names one (one engine per process, several per
host); the host is the environment's, else loopback: on several hosts set it to the address
other hosts reach this pod on (in Kubernetes: the pod IP, ``fieldRef: status.podIP``). A stage's own
``engine_args.kv_transfer_config`` wins over all of this. ``engine_extras.kv_lease_s`` (default
30, vLLM's) is how long a prefill replica keeps KV that no decode replica pulls;
``engine_extras.nixl_progress_delay_us`` paces NIXL's progress thread (:func:`pace_nixl_progress`:
1000 on CPU machines, NIXL's own 0 elsewhere).
"""

from __future__ import annotations

import os
from typing import Any

from omni_mesh.engines.kv.counts import KvCounts
from omni_mesh.engines.kv.nixl_agents import CPU_PROGRESS_DELAY_US, pace_nixl_progress
from omni_mesh.procutil import free_port

__all__ = [
    "CPU_PROGRESS_DELAY_US",
    "KvTransferCounts",
    "kv_connector_config",
    "pace_nixl_progress",
    "queued_prefill_tokens",
    "with_kv_connector",
]

PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
DEFAULT_HOST = "127.0.0.1"


def kv_connector_config(device_type: str, lease_s: int) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for a split stage's replica on ``device_type``; a
    prefill's KV that no decode replica pulls within ``lease_s`` is freed."""
    config: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        # A failed pull ends the request (it is then prefilled locally, and counted: see
        # VllmEngine.prefill_locally) rather than vLLM recomputing it unseen.
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"kv_lease_duration": lease_s},
    }
    if device_type == "cpu":
        config["kv_buffer_device"] = "cpu"  # the CPU platform's KV lives in host memory
    return config


def with_kv_connector(
    args: dict[str, Any], lease_s: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``args`` with the connector set (unless the stage sets its own), and the side channel's
    host and port in ``env`` (``os.environ`` by default: vLLM reads them there)."""
    env_map: Any = os.environ if env is None else env
    env_map.setdefault(HOST_ENV, DEFAULT_HOST)
    if not env_map.get(PORT_ENV):
        env_map[PORT_ENV] = str(free_port(env_map[HOST_ENV]))
    if args.get("kv_transfer_config") is not None:
        return args
    from vllm.platforms import current_platform

    config = kv_connector_config(current_platform.device_type, lease_s)
    return {**args, "kv_transfer_config": config}


class KvTransferCounts(KvCounts):
    """What this engine's connector moved (:class:`KvCounts`), read from vLLM's connector."""

    def install(self) -> None:
        """Read the transfer stats vLLM's worker hands its scheduler every step (vLLM drops
        them unless it logs stats): the connector's ``get_kv_connector_stats`` is wrapped to
        count them on the way. A no-op without a KV connector in this process."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return
        connector = get_kv_transfer_group()
        original = connector.get_kv_connector_stats

        def counted() -> Any:
            stats = original()
            if stats is not None:
                self.add(stats.data)
            return stats

        connector.get_kv_connector_stats = counted

    def add(self, data: dict[str, list[Any]]) -> None:
        """One step's stats (NIXL's ``NixlKVConnectorStats.data``)."""
        self.pulled += len(data.get("transfer_duration", ()))
        self.pulled_bytes += int(sum(data.get("bytes_transferred", ())))
        self.pulled_s += float(sum(data.get("transfer_duration", ())))
        self.expired += len(data.get("num_kv_expired_reqs", ()))


def queued_prefill_tokens(scheduler: Any) -> int:
    """The prompt tokens vLLM's ``scheduler`` holds and has not prefilled yet: each unfinished
    request's prompt less what was computed of it (a prefix-cache hit counts as queued until
    the request is scheduled). What a prefill replica reports, for the senders' routers to
    weigh it by; the inputs its engine process holds before handing them to vLLM are not
    counted."""
    total = 0
    for request in list(scheduler.requests.values()):
        total += max(0, int(request.num_prompt_tokens) - int(request.num_computed_tokens))
    return total
