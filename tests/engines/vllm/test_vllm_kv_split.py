"""vLLM's side of a split stage, in-process: the queued prefill tokens a replica reports
(``engines/vllm/kv_split.py``), read from a stand-in for vLLM's scheduler (the far side of
that boundary: its ``requests`` with their prompt and computed token counts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omni_mesh.engines.vllm.kv_split import queued_prefill_tokens

pytestmark = pytest.mark.unit


def scheduler(*requests: tuple[int, int]) -> SimpleNamespace:
    """A scheduler holding requests of (prompt tokens, computed tokens)."""
    held = {
        f"r{i}": SimpleNamespace(num_prompt_tokens=p, num_computed_tokens=c)
        for i, (p, c) in enumerate(requests)
    }
    return SimpleNamespace(requests=held)


def test_queued_prefill_tokens_are_the_prompts_not_computed_yet() -> None:
    assert queued_prefill_tokens(scheduler()) == 0
    # Waiting (nothing computed), half-way through a chunked prefill, decoding, prefilled.
    held = scheduler((1000, 0), (800, 300), (50, 57), (64, 64))
    assert queued_prefill_tokens(held) == 1000 + 500
