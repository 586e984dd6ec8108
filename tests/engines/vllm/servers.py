"""``tiny-llm`` through ``omni-up``, for the vLLM test modules: one shared deployment per
session (``tiny_llm_server`` in conftest: test_vllm_openai.py and test_vllm_pd_split.py's
reference), and the same stage split into prefill and decode pools (``deploy_overlay(prefill=
...)``), the prefill pool autoscaled or not (``prefill_autoscale=``). Streaming
(``async_chunk``, a chunk per token), the stage's default temperature 0 (greedy) and
``chat_template`` on."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.loader import bundled_deploy_path
from tests.procs import ManagedProcess
from tests.procs.omni_up import omni_up, stage_pools

MODEL = "tiny-llm"
SECRET = "vllm-tests-secret"  # the deployment secret: tests may send hops themselves
RUNNING = "omni_stage_engine_running_requests"


class Server:
    def __init__(self, proc: ManagedProcess, url: str, stage_urls: dict[str, list[str]]) -> None:
        self.proc = proc
        self.url = url  # the API server
        self.stage_urls = stage_urls  # the vLLM stage's pods by pool ("" unsplit)
        first = next(iter(stage_urls.values()))
        self.stage_url = first[0]
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def metric(self, url: str, line_start: str) -> float | None:
        """A sample of ``url``'s /metrics whose line starts with ``line_start``."""
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(line_start):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def running(self) -> float:
        """The vLLM engine's running batch, from the pod's /metrics (its last stats report)."""
        value = self.metric(self.stage_url, RUNNING + "{")
        return -1.0 if value is None else value

    def cp_status(self) -> str:
        """What ``omni-cp status`` prints for the deployment's control plane."""
        cp = re.search(r"control plane\s+(http://\S+)", self.proc.stdout)
        assert cp is not None, self.proc.stdout
        argv = [sys.executable, "-m", "omni_mesh.control_plane", "status", "--cp", cp[1]]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done
        return done.stdout


SPLIT_PROMPT = "the quick brown fox"


def complete(server: Server, seed: int, stream: bool = False) -> str:
    """A seeded completion (temperature 1) of the split tests' prompt, streamed or not."""
    kwargs = {"model": MODEL, "prompt": f"{SPLIT_PROMPT} {seed}", "max_tokens": 12}
    if not stream:
        out = server.client.completions.create(temperature=1.0, seed=seed, **kwargs)
        return out.choices[0].text
    chunks = server.client.completions.create(temperature=1.0, seed=seed, stream=True, **kwargs)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def kv_metric(server: Server, pool: str, outcome: str) -> float:
    """The sum over ``pool``'s pods of ``omni_stage_kv_transfers_total{outcome}``."""
    line = f'omni_stage_kv_transfers_total{{outcome="{outcome}",pipeline="{MODEL}",stage="0"}}'
    return sum(server.metric(url, line) or 0.0 for url in server.stage_urls[pool])


def handoffs(server: Server, outcome: str) -> float:
    """The API server's ``omni_stage_kv_handoffs_total{outcome}`` (remote, local, …)."""
    line = f'omni_stage_kv_handoffs_total{{from_stage="-1",outcome="{outcome}"'
    return server.metric(server.url, line) or 0.0


def deploy_overlay(
    prefill: int = 0,
    decode: int = 1,
    kv_lease_s: int = 30,
    prefill_autoscale: AutoscaleConfig | None = None,
    tensor_parallel: int = 1,
) -> str:
    """The deploy overlay of the tests' ``tiny-llm``; ``prefill`` > 0 splits its stage, whose
    prefill pool (``prefill`` its starting size) follows ``prefill_autoscale`` when given;
    ``tensor_parallel`` > 1 runs it on that many vLLM workers."""
    text = (
        f"base_config: {bundled_deploy_path(MODEL)}\n"
        "async_chunk: true\n"
        "stages:\n"
        "  - stage_id: 0\n"
        f"    num_replicas: {decode}\n"
        "    max_model_len: 2048\n"
        + (f"    tensor_parallel_size: {tensor_parallel}\n" if tensor_parallel > 1 else "")
        + "    sampling: {temperature: 0.0, max_tokens: 16}\n"
        "    engine_extras: {chunk_tokens: 1, chat_template: true"
        + (f", kv_lease_s: {kv_lease_s}}}\n" if prefill else "}\n")
    )
    if prefill:
        scale = ""
        if prefill_autoscale is not None:  # JSON is a YAML flow mapping
            scale = f", autoscale: {prefill_autoscale.model_dump_json(exclude_defaults=True)}"
        text += f"    prefill: {{num_replicas: {prefill}{scale}}}\n"
    return text


@contextmanager
def tiny_llm(
    log_dir: Path,
    prefill: int = 0,
    decode: int = 1,
    kv_lease_s: int = 30,
    prefill_autoscale: AutoscaleConfig | None = None,
    tensor_parallel: int = 1,
) -> Iterator[Server]:
    """``omni-up`` of ``tiny-llm`` (split when ``prefill``; see :func:`deploy_overlay`),
    stopped with Ctrl-C at the end."""
    overlay = log_dir / "tiny-llm.yaml"
    overlay.write_text(
        deploy_overlay(prefill, decode, kv_lease_s, prefill_autoscale, tensor_parallel)
    )
    with omni_up(MODEL, overlay, log_dir, secret=SECRET, timeout_s=200) as (proc, url):
        server = Server(proc, url, stage_pools(proc.stdout, 0, "llm"))
        try:
            yield server
        finally:
            server.client.close()  # its pooled connections (a ResourceWarning at exit else)
