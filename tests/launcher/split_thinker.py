"""qwen3-omni through ``omni-up`` with its thinker split into prefill and decode pools (deploy
``prefill:``), for the split tests: the deployment, its pods by pool, its metrics."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from omni_mesh.configs.loader import bundled_deploy_path
from tests.procs import ManagedProcess
from tests.procs.omni_up import omni_up, stage_pools

PIPELINE = "qwen3-omni"
SECRET = "split-thinker-tests-secret"


class SplitThinker:
    def __init__(self, proc: ManagedProcess, url: str, pools: dict[str, list[str]]) -> None:
        self.proc = proc
        self.url = url  # the API server
        self.pools = pools  # the thinker's pods by pool: prefill, decode
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def metric(self, url: str, line_start: str) -> float:
        """The sample of ``url``'s /metrics whose line starts with ``line_start`` (0 if none)."""
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(line_start):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def transfers(self, pool: str, outcome: str) -> float:
        """``omni_stage_kv_transfers_total{outcome}`` summed over the thinker ``pool``'s pods."""
        line = (
            f'omni_stage_kv_transfers_total{{outcome="{outcome}",pipeline="{PIPELINE}",stage="0"}}'
        )
        return sum(self.metric(url, line) for url in self.pools[pool])

    def handoffs(self, outcome: str) -> float:
        """The API server's ``omni_stage_kv_handoffs_total{outcome}`` to the thinker."""
        return self.metric(
            self.url, f'omni_stage_kv_handoffs_total{{from_stage="-1",outcome="{outcome}"'
        )


def overlay(prefill: int, decode: int) -> str:
    """The bundled qwen3-omni, its thinker on transformers (the bundled config's ``auto`` picks
    vLLM where it is installed: test_qwen3_omni_vllm_split.py splits that one) split
    ``prefill``:``decode``, one talker."""
    return (
        f"base_config: {bundled_deploy_path(PIPELINE)}\n"
        "stages:\n"
        "  - stage_id: 0\n"
        f"    num_replicas: {decode}\n"
        f"    prefill: {{num_replicas: {prefill}}}\n"
        "    engine_extras: {backend: transformers}\n"
        "  - stage_id: 1\n"
        "    num_replicas: 1\n"
    )


@contextmanager
def split_thinker(log_dir: Path, prefill: int, decode: int) -> Iterator[SplitThinker]:
    """``omni-up`` of the split deployment, stopped with Ctrl-C at the end."""
    deploy = log_dir / "qwen3-omni-split.yaml"
    deploy.write_text(overlay(prefill, decode))
    with omni_up(PIPELINE, deploy, log_dir, secret=SECRET) as (proc, url):
        deployment = SplitThinker(proc, url, stage_pools(proc.stdout, 0, "thinker"))
        try:
            yield deployment
        finally:
            deployment.client.close()
