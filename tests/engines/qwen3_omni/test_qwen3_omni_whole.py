"""qwen3-omni served 1:2:1 with ``async_chunk`` off (each stage hands its whole output on) and
its thinker on vLLM (``engine_extras.backend: vllm``: vLLM's own thinker, its hidden states
tapped, issue 33): chat's text and every PCM16 sample, text or audio in, equal transformers'
monolithic ``generate`` bit for bit through the ``openai`` SDK, and so does ``/v1/run`` called
stage by stage (thinker, talker, code2wav, each call's opaque ``stage_input`` fed to the next);
a talker's engine killed with -9 mid-request is replayed on the other talker with the same
bytes. (The transformers thinker serves the streamed topology tests beside this module.)"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.engines.qwen3_omni.omni_reference import (
    audio_messages,
    expected,
    sdk_chat,
    wav_samples,
)
from tests.sidecar.topology import Topology, answers_while_killing, post_json

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

PIPELINE = "qwen3-omni"
TEXT = [{"role": "user", "content": "hello, who are you?"}]


#: The bundled deploy config (its thinker settings: fp32, a small KV cache), whole hand-offs,
#: the thinker on vLLM whether or not auto would pick it.
OVERLAY = """\
base_config: {bundled}
async_chunk: false
stages:
  - stage_id: 0
    engine_extras: {{backend: vllm}}
"""


@pytest.fixture(scope="module")
def topo(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    log_dir = tmp_path_factory.mktemp("qwen3-omni-whole")
    overlay = log_dir / "whole.yaml"
    overlay.write_text(OVERLAY.format(bundled=bundled_deploy_path(PIPELINE)))
    top = Topology(PIPELINE, [1, 2, 1], log_dir, extra_stage_args=["--deploy-config", str(overlay)])
    try:
        top.start()
        for stage_id, count in enumerate(top.replicas):
            top.wait_discovered(stage_id, count, timeout=120)
        yield top
    finally:
        top.close()


@pytest.mark.parametrize("audio_in", [False, True], ids=["text-in", "audio-in"])
def test_whole_answers_equal_the_monolithic_model_bit_for_bit(
    topo: Topology, audio_in: bool
) -> None:
    messages = audio_messages() if audio_in else TEXT
    with openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0) as sdk:
        for seed in (3, 4):
            text, samples = sdk_chat(sdk, messages, seed, max_tokens=6)
            want_text, want_samples = expected(messages, seed, max_tokens=6)
            assert text == want_text
            assert np.array_equal(samples, want_samples)


def _run(url: str, body: dict[str, Any]) -> dict[str, Any]:
    status, raw = post_json(url + "/v1/run", body, timeout=120)
    assert status == 200, raw[:500]
    answer: dict[str, Any] = json.loads(raw)
    return answer


def test_v1_run_stage_by_stage_equals_the_monolithic_model(topo: Topology) -> None:
    prompt = "hello, who are you?"
    text, samples = expected([{"role": "user", "content": prompt}], 3, max_tokens=6)
    stage_input = {"prompt": prompt, "seed": 3, "max_tokens": 6}
    thinker = _run(topo.api_url, {"stage_id": 0, "stage_input": stage_input})
    assert thinker["next_stage_id"] == 1 and thinker["output"]["text"] == text
    talker = _run(topo.urls[1][1], {"stage_id": 1, "stage_input": thinker["stage_input"]})
    assert talker["next_stage_id"] == 2 and "output" not in talker
    code2wav = _run(topo.api_url, {"stage_id": 2, "stage_input": talker["stage_input"]})
    assert "stage_input" not in code2wav
    audio = wav_samples(base64.b64decode(code2wav["output"]["data"]))
    assert np.array_equal(audio, samples)


# Last: the killed talker's pod is gone for the rest of the module (no supervisor restarts it).
def test_a_talker_killed_mid_request_is_replayed_with_the_same_bytes(topo: Topology) -> None:
    seeds = (5, 6, 7)
    with openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0) as sdk:
        # a talker, mid-request
        results = answers_while_killing(
            topo, 1, lambda seed: sdk_chat(sdk, TEXT, seed, max_tokens=6), seeds
        )
    for seed in seeds:
        got = results[seed]
        assert not isinstance(got, Exception), got
        want_text, want_samples = expected(TEXT, seed, max_tokens=6)
        assert got[0] == want_text
        assert np.array_equal(got[1], want_samples)
