"""qwen3-omni's thinker on vLLM against the thinker on transformers (our batched decode), one
folder (tiny-qwen3-omni, float32), one machine, one run: each engine core in this process, driven
as its engine process drives it (a step, its outputs), streaming text a token per output.

1. Throughput at concurrency 1, 8 and 32: that many requests at once, 64 tokens each; output
   tokens/s, time to first token p50, engine CPU per token (this process's CPU time over the
   tokens).
2. Long prompts arriving: 4 running requests (160 tokens each) while a request with a ~2,000
   token prompt (1 token out) arrives every 24 steps; the running streams' inter-token gap
   p50/p99. vLLM prefills a long prompt in chunks between decode steps
   (``max_num_batched_tokens``: 256); the transformers thinker prefills it whole, alone, before
   the next batched step.

Targets: inter-token p99 under long-prompt arrivals ≤ 0.5x the transformers thinker's;
tokens/s at c=8 ≥ 0.8x the transformers thinker's. A tiny model on a CPU measures framework
overhead per step (about 1.5 ms per vLLM step against 1.2 ms, probed); the kernels' gain
(paged attention, CUDA graphs) shows only on a GPU.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import Options, Report
from benchmarks.measure import Target, md_table, percentile
from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Payload, StageInput, StageOutput
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import EngineContext
from omni_mesh.engines.core import EngineCore

PIPELINE = get_pipeline("qwen3-omni")
TOKENS = 64
LONG_WORDS = 1400  # ~2,000 tokens with the tiny tokenizer
VLLM_ARGS = {"block_size": 32, "kv_cache_memory_bytes": 1 << 29, "max_num_batched_tokens": 256}


def _write(arr: Any, owner: str) -> Any:
    return tensor_from_array(arr.copy())


def _core(backend: str) -> EngineCore:
    config = StageDeployConfig(
        stage_id=0,
        max_num_seqs=40,
        max_model_len=4096,
        dtype="float32",
        engine_extras={
            "model": "tiny-qwen3-omni",
            "backend": backend,
            "max_tokens_limit": 1024,
            "talker_chunk_tokens": 0,
        },
        engine_args=VLLM_ARGS if backend == "vllm" else {},
    )
    ctx = EngineContext(PIPELINE, PIPELINE.stage(0), config, async_chunk=True)
    core = EngineCore.build(ctx)
    core.engine.load()
    return core


def _request(rid: str, text: str, tokens: int) -> StageInput:
    messages = [{"role": "user", "content": text}]
    fields = {"messages": json.dumps(messages), "max_tokens": tokens, "voice": "ethan"}
    return StageInput(
        pipeline=PIPELINE.name,
        request_id=rid,
        stage_id=0,
        deadline_ms=int((time.time() + 3600) * 1000),
        seed=1,
        final_stages=(0,),  # text only: the thinker alone
        payload=Payload(fields=fields),  # type: ignore[arg-type]
    )


@dataclass
class Track:
    start: float
    times: list[float] = field(default_factory=list)
    tokens: int = 0


def _step(core: EngineCore, batch: list[StageInput], tracks: dict[str, Track]) -> None:
    now = time.monotonic()
    outs: list[tuple[StageInput, StageOutput]] = core.advance(
        [(si, now) for si in batch], array_from_tensor, _write
    )
    t = time.perf_counter()
    for _, out in outs:
        track = tracks.get(out.request_id)
        if track is None or out.error is not None:
            continue
        track.times.append(t)
        if out.last and out.final is not None:
            track.tokens = int(out.final.fields.get("completion_tokens", 0))  # type: ignore[arg-type]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def throughput(core: EngineCore, concurrency: int, tag: str) -> tuple[float, float, float]:
    """(tokens/s, TTFT p50 ms, CPU ms per token)."""
    tracks = {f"{tag}{i}": Track(time.perf_counter()) for i in range(concurrency)}
    batch = [_request(rid, f"tell me story number {i}", TOKENS) for i, rid in enumerate(tracks)]
    t0, cpu0 = time.perf_counter(), _cpu()
    _step(core, batch, tracks)
    while core.running:
        _step(core, [], tracks)
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    tokens = sum(t.tokens for t in tracks.values())
    ttft = statistics.median(t.times[0] - t.start for t in tracks.values() if t.times)
    return tokens / wall, ttft * 1000, cpu * 1000 / max(tokens, 1)


def long_prompts(core: EngineCore, tag: str) -> tuple[float, float]:
    """The running streams' inter-token gap p50/p99 (ms) while long prompts arrive."""
    tracks = {f"{tag}run{i}": Track(time.perf_counter()) for i in range(4)}
    batch = [_request(rid, f"keep talking {i}", 160) for i, rid in enumerate(tracks)]
    long_text = " ".join(f"word{i % 97}" for i in range(LONG_WORDS))
    steps = 0
    _step(core, batch, tracks)
    while core.running:
        steps += 1
        arrivals = []
        if steps % 24 == 0 and steps < 200:
            arrivals = [_request(f"{tag}long{steps}", f"{steps} {long_text}", 1)]
        _step(core, arrivals, tracks)
    gaps = [
        (b - a) * 1000 for t in tracks.values() for a, b in zip(t.times, t.times[1:], strict=False)
    ]
    return percentile(gaps, 50), percentile(gaps, 99)


async def bench(opts: Options) -> Report:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    cores = {"transformers": _core("transformers"), "vllm": _core("vllm")}
    levels = (1, 8) if opts.quick else (1, 8, 32)
    rows, figures = [], {}
    for level in levels:
        for name, core in cores.items():
            throughput(core, level, f"warm{name}{level}-")  # warm-up
            tps, ttft, cpu = throughput(core, level, f"{name}{level}-")
            figures[(name, level)] = tps
            rows.append([name, str(level), f"{tps:,.0f}", f"{ttft:.1f}", f"{cpu:.2f}"])
    itl = {name: long_prompts(core, f"{name}-") for name, core in cores.items()}
    report = Report("omni-thinkers", "qwen3-omni's thinker: vLLM against transformers")
    report.add(
        md_table(
            ["thinker", "concurrency", "tokens/s", "TTFT p50 ms", "CPU ms / token"],
            rows,
            title=f"{TOKENS} tokens per request, tiny-qwen3-omni float32, engine cores in-process",
        )
    )
    report.add(
        md_table(
            ["thinker", "inter-token p50 ms", "inter-token p99 ms"],
            [[name, f"{p50:.1f}", f"{p99:.1f}"] for name, (p50, p99) in itl.items()],
            title="4 running streams while a ~2,000-token prompt arrives every 24 steps",
        )
    )
    report.targets.append(
        Target(
            "inter-token p99 under long prompts, vLLM / transformers",
            itl["vllm"][1] / itl["transformers"][1],
            0.5,
            False,
            "x",
        )
    )
    report.targets.append(
        Target(
            "tokens/s at c=8, vLLM / transformers",
            figures[("vllm", 8)] / figures[("transformers", 8)],
            0.8,
            True,
            "x",
        )
    )
    for core in cores.values():
        core.engine.close()
    return report
