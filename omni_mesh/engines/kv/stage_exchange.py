"""The :class:`~.exchange.KvExchange` of one engine of a split stage (deploy ``prefill:``), set
from the stage's ``engine_extras``:

- ``kv_lease_s`` (30): how long a prefill's held state waits for its pull;
- ``kv_buffer_mib`` (256): the hold and the receive buffers' size each (a prompt takes
  ``token_bytes`` a token: logged at start);
- ``kv_pull_timeout_s`` (10): how long a read may take before the decode replica prefills
  instead;
- ``nixl_progress_delay_us`` (1000 on CPU, else 0): the NIXL progress thread's pause.

Used by the transformers engines for their whole prompt state (``batching/kv_split.py``) and by
the vLLM thinker for the prompt's hidden-state rows beside vLLM's own KV transfer
(``qwen3_omni/vllm_thinker_split.py``).
"""

from __future__ import annotations

import logging
import os
import uuid

from omni_mesh.engines.base import EngineConfigError, EngineContext
from omni_mesh.engines.extras import extra_float, extra_int
from omni_mesh.engines.kv.exchange import KvExchange
from omni_mesh.engines.kv.nixl_agents import CPU_PROGRESS_DELAY_US

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_MIB = 256


def stage_exchange(ctx: EngineContext, token_bytes: int, what: str = "KV") -> KvExchange:
    """The engine's exchange (module docstring); ``token_bytes`` is what one prompt token
    takes, ``what`` names what it moves in the log. An EngineConfigError without NIXL."""
    default_delay = CPU_PROGRESS_DELAY_US if ctx.device == "cpu" else 0
    name = f"{ctx.pipeline.name}-{ctx.stage.stage_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    buffer_bytes = extra_int(ctx, "kv_buffer_mib", DEFAULT_BUFFER_MIB, 1, 1 << 20) << 20
    logger.info(
        "split stage %d: %s buffers of %d MiB each, ~%d prompt tokens held (and as many "
        "pulled) at %d bytes a token (engine_extras.kv_buffer_mib)",
        ctx.stage.stage_id,
        what,
        buffer_bytes >> 20,
        buffer_bytes // max(1, token_bytes),
        token_bytes,
    )
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        raise EngineConfigError(
            f"stage {ctx.stage.stage_id} ({ctx.stage.name}): prefill: moves the prompt's "
            f"state over NIXL, which this environment lacks ({exc}; the vllm extra "
            "installs it)"
        ) from None
    return KvExchange(
        name,
        buffer_bytes=buffer_bytes,
        lease_s=extra_int(ctx, "kv_lease_s", 30, 1, 3600),
        pull_timeout_s=extra_float(ctx, "kv_pull_timeout_s", 10.0, 0.1, 3600.0),
        progress_delay_us=extra_int(ctx, "nixl_progress_delay_us", default_delay, 0, 1_000_000),
    )
