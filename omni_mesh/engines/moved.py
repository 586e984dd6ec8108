"""Engine modules that moved, for a pipeline that still names them by their old path.

A pipeline names its engines and processors as ``"module:name"`` strings. When issue #32 gave
every model family its own folder, the modules of ``engines/hf`` moved; a user's pipeline that
reuses a built-in stage under its old path keeps loading, with a DeprecationWarning naming the
new path (:func:`current_module`).
"""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger(__name__)

_OLD = "omni_mesh.engines."
#: old module (under omni_mesh.engines) -> its module now
MOVED: dict[str, str] = {
    "hf.qwen3_omni_thinker": "qwen3_omni.thinker",
    "hf.qwen3_omni_thinker_batch": "qwen3_omni.thinker_batch",
    "hf.qwen3_omni_talker": "qwen3_omni.talker",
    "hf.qwen3_omni_talker_batch": "qwen3_omni.talker_batch",
    "hf.qwen3_omni_talker_prompt": "qwen3_omni.talker_prompt",
    "hf.qwen3_omni_code2wav": "qwen3_omni.code2wav",
    "hf.qwen3_omni_inputs": "qwen3_omni.inputs",
    "hf.qwen3_omni_processors": "qwen3_omni.processors",
    "hf.qwen3_omni_tiny": "qwen3_omni.tiny",
    "hf.speakers": "qwen3_omni.speakers",
    "hf.csm_talker": "csm.talker",
    "hf.csm_talker_batch": "csm.talker_batch",
    "hf.csm_code2wav": "csm.code2wav",
    "hf.csm_processors": "csm.processors",
    "hf.csm_tiny": "csm.tiny",
    "hf.frame_batch": "batching.frame_batch",
    "hf.frame_engine": "batching.frame_engine",
    "hf.frame_stream": "batching.frame_stream",
    "hf.padded_cache": "batching.padded_cache",
    "hf.row_sampling": "batching.row_sampling",
    "hf.kv_split": "batching.kv_split",
    "hf.kv_arena": "kv.arena",
    "hf.kv_exchange": "kv.exchange",
    "hf.kv_params": "kv.params",
    "hf.kv_pull": "kv.pull",
    "nixl_agents": "kv.nixl_agents",
    "kv_counts": "kv.counts",
}


def current_module(name: str) -> str:
    """``name``, or the module it moved to (with a DeprecationWarning naming both)."""
    moved = MOVED.get(name.removeprefix(_OLD)) if name.startswith(_OLD) else None
    if moved is None:
        return name
    message = f"{name} moved to {_OLD}{moved}; name the new module in your pipeline"
    logger.warning("%s", message)  # an engine process hides DeprecationWarnings by default
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return _OLD + moved
