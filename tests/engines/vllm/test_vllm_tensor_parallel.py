"""``tiny-llm``'s vLLM stage with ``tensor_parallel_size: 2`` through ``omni-up``: vLLM's
multiprocess executor, two CPU worker processes (each bound to its own core by the stage:
``engines/vllm/cpu_binding.py``), gives the tokens of tensor parallel 1 (the session's shared
deployment), greedy and seeded, whole and streamed; its workers go with the stage, and so do
the shared-memory segments of their communicator, which vLLM leaves behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from omni_mesh.engines.vllm.cpu_binding import cpu_groups
from tests.engines.vllm.servers import MODEL, Server, complete, tiny_llm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

PROMPTS = ["once upon a time", "the tensor is split in two", "hello"]


def greedy(server: Server, prompt: str) -> str:
    out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    return out.choices[0].text


def workers() -> list[str]:
    """vLLM worker processes alive (their process titles name them: ``VLLM::Worker_TP0``)."""
    found = subprocess.run(["pgrep", "-af", "VLLM::Worker"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def worker_segments() -> set[str]:
    """The shared-memory segments of vLLM's CPU workers' communicator."""
    return {path.name for path in Path("/dev/shm").glob("vllm_dist_*")}


def test_two_ranks_give_the_tokens_of_one(tiny_llm_server: Server, tmp_path: Path) -> None:
    want = [greedy(tiny_llm_server, p) for p in PROMPTS]
    seeded = [complete(tiny_llm_server, seed) for seed in (3, 4)]
    before = worker_segments()
    with tiny_llm(tmp_path, tensor_parallel=2) as tp2:
        assert len(workers()) == 2
        assert worker_segments() - before  # theirs, while they run
        assert [greedy(tp2, p) for p in PROMPTS] == want
        assert [complete(tp2, seed) for seed in (3, 4)] == seeded
        assert complete(tp2, 3, stream=True) == seeded[0]
    assert workers() == []
    assert worker_segments() <= before  # unlinked with the stage (vLLM leaves them)


def test_cpus_are_split_into_one_group_per_rank() -> None:
    assert cpu_groups([0, 1], 2) == "0|1"
    assert cpu_groups([0, 1, 2, 3, 4], 2) == "0-2|3-4"
    assert cpu_groups([4, 0, 2, 6], 2) == "0,2|4,6"
    with pytest.raises(ValueError, match="1 CPU\\(s\\) for 2 rank"):
        cpu_groups([0], 2)
