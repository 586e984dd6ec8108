"""qwen3-omni through ``omni-up`` with its thinker on vLLM split into a prefill and a decode
replica (deploy ``prefill:``; ``engines/qwen3_omni/vllm_thinker_split.py``): vLLM's connector
moves the prompt's KV, the prefill replica's prompt rows move beside it over NIXL, and the
decode replica hands the talker every prompt and answer position in chunks (the streamed
hand-off). Chat through the ``openai`` SDK, text or audio in, equals transformers' monolithic
``generate`` (the text exactly, every PCM16 sample within one step of rounding); every answer
was decoded from pulled KV (no local prefill), and the decode replica hands the prompt rows
it never computed on to the talker.

A decode request whose params carry no prompt rows (a prefill replica of an older build), or
rows of another hold (a second pull of the same params finds its slot reused), is prefilled on
the decode replica (the second after vLLM pulled its KV: it runs again), counted failed, and
answers the same text. The prefill replica killed with -9 (pod and engine) under load fails no
request and changes no answer: a decode whose KV and rows pulls fail runs its request again
prefilled where it is, a hop whose prefill replica is gone is prefilled by the decode
replica."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from omni_mesh.data_plane.kv_transfer import PREFILL_REQUEST
from omni_mesh.data_plane.messages import Payload, Scalar, StageInput
from omni_mesh.engines.qwen3_omni.vllm_thinker_split import ROWS_KEY
from tests.engines.qwen3_omni.omni_reference import (
    assert_same_audio,
    audio_messages,
    expected,
    sdk_chat,
)
from tests.launcher.split_thinker import SplitThinker
from tests.procs import wait_until
from tests.procs.hops import hop_text, send_hop
from tests.procs.managed import ManagedProcess
from tests.procs.omni_up import omni_up, stage_pools
from tests.procs.pods import kills_under_load, pod_and_engine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

PIPELINE = "qwen3-omni"
SECRET = "qwen3-omni-split-secret"
TEXT = [{"role": "user", "content": "tell me about the sea"}]

#: The bundled deploy config (async_chunk on), the thinker on vLLM split 1 prefill : 1 decode.
OVERLAY = """\
base_config: {bundled}
stages:
  - stage_id: 0
    engine_extras: {{backend: vllm, talker_chunk_tokens: 2}}
    prefill: {{num_replicas: 1}}
"""


class Split(SplitThinker):
    """The split deployment (``tests/launcher/split_thinker.py``'s view) and its talkers."""

    def __init__(self, proc: ManagedProcess, url: str) -> None:
        super().__init__(proc, url, stage_pools(proc.stdout, 0, "thinker"))
        self.thinkers = self.pools
        self.talkers = stage_pools(proc.stdout, 1, "talker")[""]

    def fed_chunks(self) -> float:
        return sum(self.metric(url, "omni_stage_input_chunks_total") for url in self.talkers)

    def chat(self, messages: list[dict[str, Any]], seed: int, tokens: int) -> Any:
        return sdk_chat(self.client, messages, seed, max_tokens=tokens)


@pytest.fixture(scope="module")
def split(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    log_dir = tmp_path_factory.mktemp("qwen3-omni-vllm-split")
    overlay = log_dir / "split.yaml"
    overlay.write_text(OVERLAY.format(bundled=bundled_deploy_path(PIPELINE)))
    with omni_up(PIPELINE, overlay, log_dir, secret=SECRET, timeout_s=240) as (proc, url):
        top = Split(proc, url)
        try:
            assert len(top.thinkers["prefill"]) == 1 and len(top.thinkers["decode"]) == 1
            yield top
        finally:
            top.client.close()


@pytest.mark.parametrize("audio_in", [False, True], ids=["text-in", "audio-in"])
def test_the_split_thinker_answers_as_the_monolithic_model(split: Split, audio_in: bool) -> None:
    messages = audio_messages() if audio_in else TEXT
    remote, chunks = split.handoffs("remote"), split.fed_chunks()
    text, samples = split.chat(messages, 3, 12)
    want_text, want_samples = expected(messages, 3, max_tokens=12)
    assert text == want_text
    assert_same_audio(samples, want_samples)
    assert split.handoffs("remote") == remote + 1  # decoded from the pulled KV
    assert split.fed_chunks() >= chunks + 4  # the answer went on in chunks
    assert split.transfers("decode", "failed") == 0


def _input(request_id: str, kv_transfer: str) -> StageInput:
    """The thinker's input for TEXT (seed 3, 12 tokens), as the chat route's sender builds it."""
    fields: dict[str, Scalar] = {"messages": json.dumps(TEXT), "max_tokens": 12}
    return StageInput(
        pipeline=PIPELINE,
        request_id=request_id,
        stage_id=0,
        deadline_ms=int((time.time() + 60) * 1000),
        seed=3,
        payload=Payload(fields=fields),
        kv_transfer=kv_transfer,
    )


def _prefilled(split: Split, request_id: str) -> dict[str, Any]:
    """A prefill request sent straight to the prefill replica: its answer's params."""
    [answer] = send_hop(split.thinkers["prefill"][0], _input(request_id, PREFILL_REQUEST), SECRET)
    assert answer.error is None and not answer.outputs, answer
    params: dict[str, Any] = json.loads(answer.kv_transfer)
    assert params["remote_engine_id"] and params[ROWS_KEY]["tensors"], params
    return params


@pytest.mark.parametrize("tamper", ["no-rows", "reused-slot"])
def test_a_decode_without_its_prompt_rows_prefills_here(split: Split, tamper: str) -> None:
    want_text, _ = expected(TEXT, 3, max_tokens=12)
    params = _prefilled(split, f"{tamper}-prefill")
    if tamper == "no-rows":
        del params[ROWS_KEY]
    else:  # the slot holds another prefill's rows now: the read sees another tag
        params[ROWS_KEY]["hold"] = "0" * 32
    failed = split.transfers("decode", "failed")
    decode = split.thinkers["decode"][0]
    frames = send_hop(decode, _input(f"{tamper}-decode", json.dumps(params)), SECRET)
    assert [f.error for f in frames if f.error] == []
    assert hop_text(frames) == want_text
    wait_until(lambda: split.transfers("decode", "failed") >= failed + 1, 10, interval=0.2)


# Last: the prefill replica is killed (omni-up starts a new one).
def test_killing_the_prefill_replica_under_load_fails_nothing(split: Split) -> None:
    seeds = (5, 6, 7)
    audio: dict[int, list[Any]] = {seed: [] for seed in seeds}
    lock = threading.Lock()

    def call(seed: int, _stream: bool) -> str:
        text, samples = split.chat(TEXT, seed, 12)
        with lock:
            audio[seed].append(samples)
        return str(text)

    victim = pod_and_engine(split.proc.pid, split.thinkers["prefill"][0])
    results = kills_under_load(call, seeds, [victim], workers=3, pauses_s=(3.0, 5.0))
    failed = [r for r in results if not isinstance(r[1], str)]
    assert failed == [] and len(results) >= 6, failed[:3]
    for seed in seeds:
        want_text, want_samples = expected(TEXT, seed, max_tokens=12)
        assert all(text == want_text for s, text in results if s == seed)
        for samples in audio[seed]:
            assert_same_audio(samples, want_samples)
    assert re.search(
        r"process=stage0-thinker-prefill-0 pid=\d+ was killed by SIGKILL", split.proc.stderr
    ), split.proc.stderr[-3000:]
