"""Issue 35's service features, measured (``python -m benchmarks service``).

1. **Session affinity's gain**: tiny-llm on vLLM (prefix caching on, vLLM's default) as two
   headless replicas behind an ``--api-only`` API server; conversations of ~1,000-token prompts
   that grow by a sentence each turn, several at once. Time to first token of every turn after
   the first, with affinity (each conversation names itself: ``prompt_cache_key``) and without
   (a fresh random key per request: its replica is a coin toss, as without affinity), on fresh
   conversations each (no cache carried over). Target: ≥ 1.5x (without / with).
2. **The accounting's cost**: what the API server does per request for usage (a frame's timings
   and audio tallied, the counters, ``usage.omni``), timed in this process, against the API
   server's own CPU per request measured in phase 1. Target: ≤ 1%.

A tiny model on a CPU: the prefill a cache hit saves is small next to the fabric's per-request
costs, so the gain here is a floor of what a real model's 1k-token prefill shows.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from pathlib import Path

from prometheus_client import CollectorRegistry

from benchmarks.common import Options, Report
from benchmarks.fabric import Fabric
from benchmarks.load import new_session
from benchmarks.measure import CpuMeter, Target, md_table, percentile
from benchmarks.vllm import KV_BYTES, MODEL, streamed_completion, vllm_env
from omni_mesh.configs.loader import bundled_deploy_path
from omni_mesh.data_plane.messages import HopResult, Payload, StageTiming, Tensor
from omni_mesh.observability.usage_metrics import UsageMetrics
from omni_mesh.sidecar.api.usage import Usage

MAX_MODEL_LEN = 2048
HISTORY_WORDS = 520  # ~1,000 prompt tokens with the tiny tokenizer (~1.9 a word)
WORDS = [
    "the",
    "sea",
    "is",
    "calm",
    "and",
    "the",
    "sky",
    "is",
    "wide",
    "over",
    "a",
    "small",
    "boat",
    "with",
    "two",
    "people",
]


def _overlay(folder: Path, model_dir: Path) -> Path:
    path = folder / "tiny-llm-service.yaml"
    path.write_text(
        f"base_config: {bundled_deploy_path(MODEL)}\n"
        "async_chunk: true\n"
        "stages:\n"
        "  - stage_id: 0\n"
        f"    max_model_len: {MAX_MODEL_LEN}\n"
        f"    engine_args: {{model: {model_dir}, seed: 0, kv_cache_memory_bytes: {KV_BYTES}}}\n"
        "    engine_extras: {chunk_tokens: 1}\n"
    )
    return path


def _history(conversation: str) -> str:
    """A conversation's first prompt: its name first (its prompt shares no prefix with any
    other), then ordinary words."""
    words = [WORDS[(i * 7) % len(WORDS)] for i in range(HISTORY_WORDS)]
    return f"conversation {conversation}: " + " ".join(words)


async def _conversations(url: str, mode: str, conversations: int, turns: int) -> list[float]:
    """TTFT (s) of every turn after the first, ``conversations`` at once."""
    ttfts: list[float] = []

    async def one(i: int) -> None:
        name = f"{mode}-{i}-{uuid.uuid4().hex[:6]}"
        prompt = _history(name)
        async with new_session(1) as sess:
            for turn in range(turns):
                prompt += f" and then turn {turn} came."
                key = name if mode == "affinity" else uuid.uuid4().hex
                body = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": 2,
                    "temperature": 0.0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "prompt_cache_key": key,
                }
                t0 = time.monotonic()
                times, _ = await streamed_completion(sess, url, body)
                if turn:
                    ttfts.append(times[0] - t0)

    await asyncio.gather(*(one(i) for i in range(conversations)))
    return ttfts


def _accounting_us(reps: int) -> float:
    """Microseconds of the API server's usage work for one request of three stages whose
    answer came in 10 audio frames."""
    metrics = UsageMetrics(CollectorRegistry())
    audio = Payload(
        fields={"sample_rate": 24000},
        tensors={"waveform": Tensor(dtype="float32", shape=(1920,))},
    )
    frames = [HopResult(request_id="r", outputs={2: audio}, more=True) for _ in range(9)]
    timings = [StageTiming(s, "i", 1.0, 0.1, 2.0, used_ms=1.0) for s in range(3)]
    frames.append(HopResult(request_id="r", outputs={2: audio}, timings=timings))
    t0 = time.perf_counter()
    for _ in range(reps):
        usage = Usage(audio_stage=2, audio_in_s=1.0)
        for frame in frames:
            usage.add(frame)
        usage.record(metrics, "bench", "tenant")
        usage.extension()
    return (time.perf_counter() - t0) / reps * 1e6


async def bench(opts: Options) -> Report:
    conversations = opts.pick(4, 2)
    turns = opts.pick(5, 3)
    rows: list[list[str]] = []
    results: dict[str, list[float]] = {}
    with vllm_env() as model_dir, Fabric("service", pipeline=MODEL) as fab:
        fab.deploy_config = _overlay(fab.log_dir, model_dir)
        fab.start_cp()
        replicas = [fab.add_stage(0, wait=False) for _ in range(2)]
        api = fab.add_stage(0, api_only=True, wait=False)
        fab.wait_ready([*replicas, api], timeout=300)
        fab.wait_discovered(0, 2, timeout=120)
        await _conversations(api.url, "warm", 2, 2)  # compiled paths, connections
        meter = CpuMeter({"api": [api.pid]})
        meter.start()
        requests = 0
        for mode in ("none", "affinity"):
            results[mode] = await _conversations(api.url, mode, conversations, turns)
            requests += conversations * turns
        meter.stop()
        api_us = meter.used["api"] / requests * 1e6
    for mode in ("none", "affinity"):
        ttft = results[mode]
        rows.append(
            [
                mode,
                str(len(ttft)),
                f"{statistics.median(ttft) * 1000:.1f}",
                f"{percentile(ttft, 90) * 1000:.1f}",
            ]
        )
    gain = statistics.median(results["none"]) / statistics.median(results["affinity"])
    accounting = _accounting_us(opts.pick(20_000, 2_000))
    report = Report("service", "session affinity's TTFT gain; the usage accounting's cost")
    report.add(
        md_table(
            ["affinity", "turns timed", "TTFT p50 ms", "TTFT p90 ms"],
            rows,
            title=(
                f"tiny-llm (vLLM, prefix caching) x2 replicas, {conversations} conversations of "
                f"~1k-token prompts at once, turns 2..{turns}"
            ),
        )
    )
    report.add(
        md_table(
            ["per request", "µs"],
            [
                ["usage accounting (tally, counters, usage.omni)", f"{accounting:.1f}"],
                ["API server CPU (phase 1)", f"{api_us:.0f}"],
            ],
            title="The accounting's cost",
        )
    )
    report.targets.append(Target("affinity TTFT gain (without / with)", gain, 1.5, True, "x"))
    report.targets.append(
        Target(
            "usage accounting / API server CPU per request",
            accounting / api_us * 100,
            1.0,
            False,
            "%",
        )
    )
    return report
