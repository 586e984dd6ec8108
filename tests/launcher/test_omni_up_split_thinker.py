"""qwen3-omni through ``omni-up`` with its thinker split into a prefill and a decode pool
(deploy ``prefill:``; transformers engines, the prompt's state moved engine to engine over real
NIXL: ``engines/batching/kv_split.py``), 1P:1D and 1P:2D, through the official ``openai`` SDK.

Every answer, text and audio, streamed and not, text in and audio in, is transformers'
monolithic ``generate``'s for the same seed, decoded from state the decode engines pulled
(counted, bytes and all; no local prefill); ``omni-cp status`` shows each pool's role; idle,
the split engines leave the cores alone. Killing
the prefill replica (pod and engine, SIGKILL) and then a decode replica under load fails no
request and changes no answer: hops whose prefill replica is gone are prefilled by a decode
replica (counted ``local``), and a cut decode is replayed elsewhere; the killed pods' engine
temp folders are removed by the replicas started in their place."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engines.qwen3_omni.omni_reference import (
    assert_same_audio,
    audio_messages,
    expected,
    sdk_chat,
)
from tests.launcher.split_thinker import PIPELINE, SplitThinker, split_thinker
from tests.procs import wait_until
from tests.procs.pods import engine_pids, idle_core_shares, kills_under_load, pod_and_engine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

TEXT = [{"role": "user", "content": "tell me a story about a small robot"}]
SEEDS = (3, 4, 5)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def one_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SplitThinker]:
    with split_thinker(tmp_path_factory.mktemp("split-1p1d"), prefill=1, decode=1) as up:
        assert [len(up.pools["prefill"]), len(up.pools["decode"])] == [1, 1]
        yield up


@pytest.fixture(scope="module")
def one_two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SplitThinker]:
    with split_thinker(tmp_path_factory.mktemp("split-1p2d"), prefill=1, decode=2) as up:
        assert [len(up.pools["prefill"]), len(up.pools["decode"])] == [1, 2]
        yield up


def chat(up: SplitThinker, messages: list[dict[str, Any]], seed: int) -> tuple[str, np.ndarray]:
    return sdk_chat(up.client, messages, seed, MAX_TOKENS)


def text_chat(up: SplitThinker, seed: int, stream: bool = False, user: str | None = None) -> str:
    """A text-only answer (the thinker alone), streamed or not; ``user`` names its session
    (one conversation's turns keep to one decode replica: session affinity)."""
    kwargs: dict[str, Any] = {"model": PIPELINE, "messages": TEXT, "seed": seed}
    if user is not None:
        kwargs["user"] = user
    if not stream:
        out = up.client.chat.completions.create(max_tokens=MAX_TOKENS, **kwargs)
        return out.choices[0].message.content or ""
    chunks = up.client.chat.completions.create(max_tokens=MAX_TOKENS, stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("audio_in", [False, True], ids=["text-in", "audio-in"])
def test_one_prefill_and_one_decode_replica_answer_as_the_monolithic_model(
    one_one: SplitThinker, audio_in: bool
) -> None:
    messages = audio_messages() if audio_in else TEXT
    pulled = one_one.transfers("decode", "pulled")
    text, samples = chat(one_one, messages, seed=7)
    want_text, want_samples = expected(messages, seed=7, max_tokens=MAX_TOKENS)
    assert text == want_text
    assert_same_audio(samples, want_samples)
    wait_until(lambda: one_one.transfers("decode", "pulled") == pulled + 1, 10, interval=0.2)
    assert one_one.handoffs("local") == 0 and one_one.transfers("decode", "failed") == 0


def test_one_prefill_and_two_decode_replicas_answer_as_the_monolithic_model(
    one_two: SplitThinker,
) -> None:
    pulled = one_two.transfers("decode", "pulled")
    for seed in SEEDS:
        want = expected(TEXT, seed=seed, max_tokens=MAX_TOKENS)[0]
        assert text_chat(one_two, seed) == want
        assert text_chat(one_two, seed, stream=True) == want
    calls = 2 * len(SEEDS)
    wait_until(lambda: one_two.transfers("decode", "pulled") >= pulled + calls, 10, interval=0.2)
    # both decode replicas pulled, from the one prefill replica (one conversation keeps to one
    # decode replica: the users of these turns differ, and the router spreads their sessions)
    pulled_line = f'omni_stage_kv_transfers_total{{outcome="pulled",pipeline="{PIPELINE}"'

    def pulled_by() -> list[float]:
        return [one_two.metric(url, pulled_line) for url in one_two.pools["decode"]]

    for seed in range(100, 120):
        if all(n > 0 for n in pulled_by()):
            break
        want = expected(TEXT, seed=seed, max_tokens=MAX_TOKENS)[0]
        assert text_chat(one_two, seed, user=f"user-{seed}") == want
        calls += 1
        time.sleep(0.6)  # the pods' next engine stats
    assert all(n > 0 for n in pulled_by()), pulled_by()
    bytes_line = f'omni_stage_kv_transfer_bytes_total{{pipeline="{PIPELINE}",stage="0"}}'
    assert sum(one_two.metric(u, bytes_line) for u in one_two.pools["decode"]) > 0
    assert one_two.handoffs("remote") >= calls and one_two.handoffs("local") == 0
    assert one_two.transfers("decode", "failed") == 0
    assert one_two.transfers("prefill", "pulled") == 0  # the prefill engine only serves reads
    cp = re.search(r"control plane\s+(http://\S+)", one_two.proc.stdout)
    assert cp is not None
    status = subprocess.run(
        [sys.executable, "-m", "omni_mesh.control_plane", "status", "--cp", cp[1]],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert status.stdout.count("headless/prefill") == 1, status
    assert status.stdout.count("headless/decode") == 2, status


def test_idle_split_engines_leave_the_cores_alone(one_one: SplitThinker) -> None:
    # NIXL's progress thread spins a whole core per agent unless paced (nixl_agents.py).
    engines = engine_pids(one_one.proc.pid, one_one.pools["prefill"] + one_one.pools["decode"])
    assert len(engines) == 2, engines
    used = idle_core_shares(engines)
    assert all(share < 0.3 for share in used.values()), used  # cores per engine, idle


def test_killing_the_prefill_and_a_decode_replica_under_load_fails_nothing(
    one_two: SplitThinker,
) -> None:
    want = {seed: expected(TEXT, seed=seed, max_tokens=MAX_TOKENS)[0] for seed in SEEDS}
    prefill, decode = one_two.pools["prefill"][0], one_two.pools["decode"][1]
    victims = [pod_and_engine(one_two.proc.pid, prefill), pod_and_engine(one_two.proc.pid, decode)]
    results = kills_under_load(
        lambda seed, stream: text_chat(one_two, seed, stream=stream),
        SEEDS,
        victims,  # the prefill replica (its pod and its engine), then a decode replica
        workers=4,
        pauses_s=(2.0, 2.0, 2.0),
    )
    failed = [r for r in results if not isinstance(r[1], str)]
    assert failed == [] and len(results) > 10, failed[:3]
    assert all(text == want[seed] for seed, text in results), results
    assert one_two.handoffs("local") >= 1  # the prefill pool was gone a while
    assert re.search(
        r"process=stage0-thinker-prefill-0 pid=\d+ was killed by SIGKILL", one_two.proc.stderr
    )
    # Killed with their engines, neither pod could remove its engine's temp folder: the
    # replicas omni-up started in their place removed them.
    tmp = Path(tempfile.gettempdir())
    wait_until(
        lambda: not [p for pids in victims for p in tmp.glob(f"omni-engine-s0-p{pids[0]}-*")],
        60,
        interval=0.5,
    )
