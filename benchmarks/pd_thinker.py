"""Prefill/decode split of qwen3-omni's thinker (transformers; the engine moves the prompt's
state over NIXL itself: ``engines/batching/kv_split.py``) against the same thinker unsplit, the same
machine, one run: ``tiny-qwen3-omni``'s thinker split 1P:1D against two unsplit thinker
replicas, and one unsplit replica, through ``omni-up`` (one talker and one code2wav idle
beside them: the load is text-only chat, the thinker alone), one deployment after the other.

The load is ``benchmarks/pd.py``'s mixed open-loop load, as streamed chat completions: decode
requests (a short message, ``DECODE_TOKENS`` tokens, greedy) and long-prompt requests (a
``pd.LONG_WORDS``-word message, each unique from its first word, ``LONG_MAX_TOKENS`` tokens
out). Measured: inter-token gaps of the decode requests (p50/p99), the long requests' time to
first token, output tokens/s, and the split's pulls, bytes per pull and transfer time (the
decode pod's ``omni_stage_kv_transfer_*`` counters). The thinker prefills a prompt alone,
between two batched decode steps, so unsplit every long prompt stalls every running stream of
its replica for its whole prefill.

Target: decode inter-token p99 ≤ 0.5x the 2-replica unsplit figure at equal tokens/s.
"""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp

from benchmarks.common import Options, Report
from benchmarks.pd import Run, deployment, mixed_load, tables, three_runs
from benchmarks.vllm import chat_text, streamed_completion
from omni_mesh.configs.loader import bundled_deploy_path

PIPELINE = "qwen3-omni"
DECODE_RATE = 6.0
LONG_RATE = 3.0
DECODE_TOKENS = 48
LONG_MAX_TOKENS = 8


def _overlay(folder: Path, split: bool, replicas: int) -> Path:
    path = folder / f"thinker-{'split' if split else 'unsplit'}-{replicas}.yaml"
    text = (
        f"base_config: {bundled_deploy_path(PIPELINE)}\n"
        "request_timeout_s: 120\n"
        "stages:\n"
        "  - stage_id: 0\n"
        f"    num_replicas: {replicas}\n"
        "    max_num_seqs: 64\n"
        "    max_inflight: 256\n"
    )
    if split:
        text += "    prefill: {num_replicas: 1}\n"
    text += "  - stage_id: 1\n    num_replicas: 1\n"
    path.write_text(text)
    return path


async def _chat(
    sess: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, seed: int
) -> tuple[float, list[float], int, int]:
    """One streamed text-only chat: (time to first token event, token event times, tokens,
    prompt tokens)."""
    body = {
        "model": PIPELINE,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    times, usage = await streamed_completion(sess, url, body, "/v1/chat/completions", chat_text)
    return times[0] - t0, times, usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0)


async def _deployment(log_dir: Path, split: bool, replicas: int, window_s: float) -> Run:
    return await deployment(
        PIPELINE,
        _overlay(log_dir, split, replicas),
        log_dir,
        split,
        replicas,
        r"stage 0 thinker-decode #\d+\s+(http://\S+)",
        lambda url, name: mixed_load(
            url,
            name,
            window_s,
            (DECODE_RATE, LONG_RATE),
            stream=_chat,
            decode_tokens=DECODE_TOKENS,
            long_max_tokens=LONG_MAX_TOKENS,
        ),
    )


async def bench(opts: Options) -> Report:
    report = Report(
        "pd-thinker",
        "Prefill/decode split of qwen3-omni's thinker: 1P:1D vs 2 unsplit replicas under a "
        "mixed load",
    )
    window_s = opts.pickf(30.0, 10.0)
    runs = await three_runs(
        "omni-bench-pd-thinker-",
        lambda log_dir, split, replicas: _deployment(log_dir, split, replicas, window_s),
    )
    tables(report, runs, window_s, (DECODE_RATE, LONG_RATE), (DECODE_TOKENS, LONG_MAX_TOKENS))
    report.notes.append(
        "Every deployment runs omni-cp, an API server, its thinker engines (tiny-qwen3-omni on "
        "transformers, float32, one torch thread each) and an idle talker and code2wav on the "
        "same 2 cores, one deployment after the other. A pull moves the prompt's KV cache, its "
        "input embeddings and accept-layer hidden states (the talker's inputs), the first "
        "token, positions and sampler state: bytes per pull above."
    )
    report.notes.append(
        "What 2 cores cannot show: the prefill engine's forward still takes CPU time from the "
        "decode engine (the OS schedules both on the same cores), and the unsplit pair spreads "
        "its streams over two engines where the split decodes them all on one. On a GPU per "
        "engine the split takes the prefill out of the decode steps entirely."
    )
    return report
