"""NIXL agents made in an engine process: paced progress threads, and the agents the
transformers engines make for a split stage (``exchange.py``; vLLM's connector makes its
own, paced the same way)."""

from __future__ import annotations

import importlib
import types
from typing import Any

#: The NIXL progress thread's pause between rounds on CPU machines, microseconds.
CPU_PROGRESS_DELAY_US = 1000


def pace_nixl_progress(delay_us: int) -> bool:
    """Give NIXL agents made in this process a progress thread that pauses ``delay_us``
    between rounds; True when applied.

    NIXL's Python wrapper (1.5) builds every agent with ``pthrDelay = 0``, and its UCX
    progress thread then spins: measured here, one whole core per engine, prefill and decode,
    idle or not: on a CPU machine the core its model needs. With 1 ms the same transfers pass
    and an idle engine uses ~5% of a core. The wrapper's module is vLLM's ``nixl._api``
    backend (``nixl_cu12``, …); its ``nixlBind`` is wrapped so the agent config it makes
    takes the delay. 0 keeps NIXL's own behaviour."""
    if delay_us <= 0:
        return False
    from nixl._api import nixl_agent

    api: Any = importlib.import_module(nixl_agent.__module__)
    bindings = api.nixlBind
    if getattr(bindings, "omni_paced", False):
        return True

    class PacedConfig(bindings.nixlAgentConfig):  # type: ignore[misc,name-defined]
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    names = {k: getattr(bindings, k) for k in dir(bindings) if not k.startswith("__")}
    names.update(nixlAgentConfig=PacedConfig, omni_paced=True)
    paced = types.SimpleNamespace(**names)
    api.nixlBind = paced
    return True


def nixl_agent(name: str, delay_us: int) -> Any:
    """A NIXL agent named ``name`` on the UCX backend, its progress thread paced by
    ``delay_us`` (:func:`pace_nixl_progress`; 0: NIXL's own spin)."""
    pace_nixl_progress(delay_us)
    from nixl._api import nixl_agent as make
    from nixl._api import nixl_agent_config

    return make(name, nixl_agent_config(backends=["UCX"]))
