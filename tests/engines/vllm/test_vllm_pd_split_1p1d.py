"""The smallest split: ``tiny-llm`` as one prefill and one decode replica through ``omni-up``
(test_vllm_pd_split.py runs 1P:2D and its failures). Every answer, streamed and not, is the
unsplit stage's for the same seed, and every one was decoded from KV the decode engine pulled
from the prefill engine over NIXL (no local prefill)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engines.vllm.servers import Server, complete, handoffs, kv_metric, tiny_llm
from tests.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEEDS = (4, 5, 6)


@pytest.fixture(scope="module")
def split(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_llm(tmp_path_factory.mktemp("vllm-1p1d"), prefill=1, decode=1) as server:
        assert len(server.stage_urls["prefill"]) == 1 and len(server.stage_urls["decode"]) == 1
        yield server


def test_one_prefill_and_one_decode_replica_answer_as_the_unsplit_stage(
    split: Server, tiny_llm_server: Server
) -> None:
    for seed in SEEDS:
        expected = complete(tiny_llm_server, seed)
        assert expected and complete(split, seed) == expected
        assert complete(split, seed, stream=True) == expected
    calls = 2 * len(SEEDS)
    wait_until(lambda: kv_metric(split, "decode", "pulled") >= calls, 10, interval=0.2)
    assert handoffs(split, "remote") == calls and handoffs(split, "local") == 0
    assert kv_metric(split, "decode", "failed") == 0
