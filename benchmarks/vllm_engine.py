"""vLLM's engine alone, in-process: the ceiling for a vLLM stage (``python -m benchmarks vllm``).

Run as a child process by :mod:`benchmarks.vllm`::

    python -m benchmarks.vllm_engine DEPLOY_YAML --plan 1:20,16:96

It builds the engine from the very deploy config the omni-mesh stage runs (the same model folder
and engine arguments, through ``build_engine_args``), as vLLM's ``LLMEngine`` with its engine
core in this process, one torch thread (as in a stage's engine process), and drives it directly:
no server, no sidecar, no hop. For each ``concurrency:requests`` of the plan: ``concurrency``
warm-up requests, then ``requests`` greedy completions of 64 tokens (``ignore_eos``, streamed as
deltas), kept ``concurrency`` in flight (a new one added when one finishes, as a closed-loop
client does). Time to first token is from ``add_request`` to the step that produced the first
token; inter-token latency per request is (last token's step - first's) / (tokens - 1), as the
HTTP clients compute it. Prints one JSON line: ``{"phases": [{"concurrency", "wall_s",
"streams": [[ttft_s, itl_s | null, tokens], ...]}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_TOKENS = 64


@dataclass
class Timeline:
    """When one request was added and when each step gave it tokens."""

    added: float
    steps: list[float] = field(default_factory=list)
    tokens: int = 0

    def record(self, now: float, new_tokens: int) -> None:
        if new_tokens > 0:
            self.steps.append(now)
            self.tokens += new_tokens

    def figures(self) -> tuple[float, float | None, int]:
        """(time to first token, inter-token latency or None under 2 tokens, tokens)."""
        if not self.steps:
            raise RuntimeError("a request finished without a token")
        itl = (self.steps[-1] - self.steps[0]) / (self.tokens - 1) if self.tokens > 1 else None
        return self.steps[0] - self.added, itl, self.tokens


def parse_plan(text: str) -> list[tuple[int, int]]:
    """``"1:20,16:96"`` as ``[(1, 20), (16, 96)]`` (concurrency, requests; both ≥ 1)."""
    plan: list[tuple[int, int]] = []
    for part in text.split(","):
        c, sep, n = part.partition(":")
        if not sep or not c.strip().isdigit() or not n.strip().isdigit():
            raise ValueError(f"plan entry {part!r} is not CONCURRENCY:REQUESTS")
        if int(c) < 1 or int(n) < 1:
            raise ValueError(f"plan entry {part!r}: both must be at least 1")
        plan.append((int(c), int(n)))
    return plan


def _engine(deploy: Path) -> Any:
    from omni_mesh.configs.loader import load_deploy_config
    from omni_mesh.configs.registry import get_pipeline
    from omni_mesh.engines.vllm.args import build_engine_args, make_vllm_config

    config = load_deploy_config(deploy, get_pipeline("tiny-llm")).stage(0)
    args = build_engine_args(config)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch.set_num_threads(1)  # a stage's engine process runs one torch thread
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    vllm_config = make_vllm_config(args, 0)
    return LLMEngine(
        vllm_config=vllm_config,
        executor_class=Executor.get_class(vllm_config),
        log_stats=False,
        multiprocess_mode=False,
    )


def _run(engine: Any, concurrency: int, requests: list[int]) -> tuple[float, list[Timeline]]:
    """``requests`` (prompt numbers) kept ``concurrency`` in flight; wall time and timelines."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    queue = list(requests)
    live: dict[str, Timeline] = {}
    done: list[Timeline] = []

    def add() -> None:
        i = queue.pop()
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i, detokenize=True
        )
        params.output_kind = RequestOutputKind.DELTA
        rid = f"bench-{i}"
        live[rid] = Timeline(time.monotonic())
        engine.add_request(rid, {"prompt": f"benchmark prompt number {i} says"}, params)

    t0 = time.monotonic()
    while queue and len(live) < concurrency:
        add()
    while live:
        outs = engine.step()
        now = time.monotonic()
        for out in outs:
            timeline = live.get(out.request_id)
            if timeline is None:
                continue
            timeline.record(now, sum(len(o.token_ids) for o in out.outputs))
            if out.finished:
                done.append(live.pop(out.request_id))
                if queue:
                    add()
    return time.monotonic() - t0, done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_engine", description=__doc__)
    p.add_argument("deploy", type=Path, help="the tiny-llm deploy config the stage runs")
    p.add_argument("--plan", type=parse_plan, required=True, help="C:N,C:N (e.g. 1:20,16:96)")
    args = p.parse_args(argv)
    engine = _engine(args.deploy)
    phases = []
    try:
        for concurrency, n in args.plan:
            _run(engine, concurrency, [10_000 + i for i in range(concurrency)])  # warm-up
            wall, done = _run(engine, concurrency, list(range(n)))
            streams = [list(t.figures()) for t in done]
            phases.append({"concurrency": concurrency, "wall_s": wall, "streams": streams})
    finally:
        engine.engine_core.shutdown()
    sys.stdout.write(json.dumps({"phases": phases}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
