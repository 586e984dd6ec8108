"""A split stage's prefill load in prompt tokens (``sidecar/hop/prefill_tokens.py``): what a
sender counts of its own prompts (exact for token ids, an estimate for text), and a replica's
queued prefill tokens carried by its heartbeat through a real omni-cp to the senders' watch
cache."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    InstanceLease,
    LoadReport,
    PipelineSnapshot,
    PoolWatcher,
    RegisterRequest,
)
from omni_mesh.data_plane.messages import Payload
from omni_mesh.data_plane.tensors import tensor_from_array
from omni_mesh.sidecar.hop.prefill_tokens import (
    PREFILL_TOKENS_QUEUED,
    estimate_text_tokens,
    prompt_tokens,
    reported_prefill_tokens,
)
from tests.procs import ControlPlaneProcess


@pytest.mark.unit
def test_the_text_estimate_is_utf8_bytes_over_four_and_at_least_one() -> None:
    assert estimate_text_tokens("x" * 400) == 100
    assert estimate_text_tokens("x" * 403) == 100
    assert estimate_text_tokens("é" * 10) == 5  # 2 bytes each
    assert estimate_text_tokens("音" * 8) == 6  # 3 bytes each
    assert estimate_text_tokens("hi") == 1 and estimate_text_tokens("") == 1


@pytest.mark.unit
def test_token_ids_give_the_exact_count_and_text_an_estimate() -> None:
    ids = tensor_from_array(np.arange(37, dtype=np.int64))
    assert prompt_tokens(Payload(fields={"prompt": "x" * 4000}, tensors={"token_ids": ids})) == 37
    assert prompt_tokens(Payload(fields={"prompt": "x" * 400})) == 100
    # A chat's whole conversation (what a chat-templated engine prefills) over its last turn.
    chat = Payload(fields={"prompt": "x" * 40, "messages": "y" * 800})
    assert prompt_tokens(chat) == 200
    empty = tensor_from_array(np.zeros(0, dtype=np.int64))
    assert prompt_tokens(Payload(fields={"prompt": "x" * 80}, tensors={"token_ids": empty})) == 20
    assert prompt_tokens(Payload()) == 1  # nothing to count: a prompt is never free


@pytest.mark.unit
def test_the_reported_figure_is_read_from_the_load_report() -> None:
    assert reported_prefill_tokens(None) == 0
    assert reported_prefill_tokens(LoadReport(in_flight=3)) == 0  # an older peer: none
    assert reported_prefill_tokens(LoadReport(engine={PREFILL_TOKENS_QUEUED: 1234.0})) == 1234


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_heartbeats_queued_prefill_tokens_reach_the_senders_watch_cache(
    cp_factory: Callable[..., ControlPlaneProcess],
) -> None:
    cp = cp_factory(heartbeat_interval_ms=200, lease_ttl_ms=1000, sweep_interval_ms=100)
    queued = [0.0]
    request = RegisterRequest(
        pipeline="tiny-llm",
        stage_id=0,
        address="http://127.0.0.1:9701",
        capacity=4,
        labels={"kv_role": "prefill"},
    )
    async with ControlPlaneClient([cp.url]) as client:
        lease = InstanceLease(
            client, request, lambda: LoadReport(engine={PREFILL_TOKENS_QUEUED: queued[0]})
        )
        await lease.start()
        watcher = PoolWatcher(client, "tiny-llm", resync_interval_s=0.2)
        await watcher.start()
        try:

            def reported(tokens: int) -> Callable[[PipelineSnapshot], bool]:
                def check(snapshot: PipelineSnapshot) -> bool:
                    loads = [i.load for i in snapshot.healthy(0)]
                    return [reported_prefill_tokens(load) for load in loads] == [tokens]

                return check

            await watcher.wait_for(reported(0), 5)
            queued[0] = 4096.0  # the engine's queue grew: the next heartbeats say so
            await watcher.wait_for(reported(4096), 5)
        finally:
            await watcher.stop()
            await lease.stop()
