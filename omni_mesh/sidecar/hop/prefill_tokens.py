"""A split stage's prefill load in prompt tokens: what the router weighs a prefill replica by.

Two figures, both in prompt tokens:

- what a sender puts on a prefill replica: the prompt of each prefill request it sent and
  that has no answer yet (:func:`prompt_tokens`). A payload carrying ``token_ids`` gives the
  exact count; a text prompt gives an **estimate** (:func:`estimate_text_tokens`), since the
  tokenizer runs in the receiving engine only;
- what a prefill replica reports in its heartbeats: its engine's prompt tokens not prefilled
  yet, every sender's (the ``LoadReport`` engine figure :data:`PREFILL_TOKENS_QUEUED`; read
  back with :func:`reported_prefill_tokens`). A free-form engine figure rather than a field of
  its own, so that a control plane that predates it still takes the heartbeat.
"""

from __future__ import annotations

import math

from omni_mesh.control_plane.client import LoadReport
from omni_mesh.data_plane.messages import Payload

#: The ``LoadReport.engine`` figure of a split stage's replica: its queued prefill tokens.
PREFILL_TOKENS_QUEUED = "prefill_tokens_queued"
#: UTF-8 bytes per token of the text estimate (about right for English under BPE tokenizers;
#: fewer bytes per token for code, more for CJK text).
BYTES_PER_TOKEN = 4


def estimate_text_tokens(text: str) -> int:
    """An estimate of the tokens of ``text``: its UTF-8 bytes / :data:`BYTES_PER_TOKEN`,
    at least 1 (a prompt is never free)."""
    return max(1, len(text.encode()) // BYTES_PER_TOKEN)


def prompt_tokens(payload: Payload) -> int:
    """The prompt tokens a stage input puts on a prefill replica: the length of its
    ``token_ids`` tensor (what a vLLM engine prefills when it is there); else an estimate
    from its text: the ``messages`` field (the whole conversation, which a chat-templated
    engine prefills) or the ``prompt`` field."""
    ids = payload.tensors.get("token_ids")
    if ids is not None and (n := math.prod(ids.shape)) > 0:
        return n
    for name in ("messages", "prompt"):
        text = payload.fields.get(name)
        if isinstance(text, str) and text:
            return estimate_text_tokens(text)
    return 1


def reported_prefill_tokens(load: LoadReport | None) -> int:
    """The queued prefill tokens a replica's heartbeat reported (0: none reported)."""
    if load is None:
        return 0
    value = load.engine.get(PREFILL_TOKENS_QUEUED, 0.0)
    if not math.isfinite(value):  # a broken report must not break the whole pool's view
        return 0
    return max(0, int(value))
