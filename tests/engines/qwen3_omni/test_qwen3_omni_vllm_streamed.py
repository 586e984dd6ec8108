"""qwen3-omni 2:2:1 with its thinker on vLLM (``engine_extras.backend: vllm``) and the streamed
hand-off (``async_chunk`` on: the thinker hands its answer to a talker in chunks as vLLM makes
it, the talker pulls them from the thinker's sidecar): chat through the ``openai`` SDK, text or
audio in, equals transformers' monolithic ``generate`` (the text exactly, every PCM16 sample
within one step of rounding, as the streamed transformers topology); a thinker's engine killed
with -9 mid-answer is replayed on the other thinker, whose own stream the talkers then follow,
with the same answers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.engines.qwen3_omni.omni_reference import (
    assert_same_audio,
    audio_messages,
    expected,
    sdk_chat,
)
from tests.sidecar.topology import Topology, answers_while_killing

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

PIPELINE = "qwen3-omni"
TEXT = [{"role": "user", "content": "tell me about the sea"}]

#: The bundled deploy config (async_chunk on; its thinker settings: fp32, a small KV cache), the
#: thinker on vLLM whether or not auto would pick it.
OVERLAY = """\
base_config: {bundled}
stages:
  - stage_id: 0
    engine_extras: {{backend: vllm, talker_chunk_tokens: 2}}
"""


@pytest.fixture(scope="module")
def topo(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    log_dir = tmp_path_factory.mktemp("qwen3-omni-vllm-streamed")
    overlay = log_dir / "streamed.yaml"
    overlay.write_text(OVERLAY.format(bundled=bundled_deploy_path(PIPELINE)))
    top = Topology(PIPELINE, [2, 2, 1], log_dir, extra_stage_args=["--deploy-config", str(overlay)])
    try:
        top.start()
        for stage_id, count in enumerate(top.replicas):
            top.wait_discovered(stage_id, count, timeout=180)
        yield top
    finally:
        top.close()


def fed_chunks(topo: Topology) -> float:
    return sum(topo.metric(url, "omni_stage_input_chunks_total") for url in topo.urls[1])


def chat(topo: Topology, messages: list[dict[str, Any]], seed: int, tokens: int) -> Any:
    with openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0) as sdk:
        return sdk_chat(sdk, messages, seed, max_tokens=tokens)


@pytest.mark.parametrize("audio_in", [False, True], ids=["text-in", "audio-in"])
def test_streamed_hand_off_equals_the_monolithic_model(topo: Topology, audio_in: bool) -> None:
    messages = audio_messages() if audio_in else TEXT
    before = fed_chunks(topo)
    text, samples = chat(topo, messages, 3, 12)
    want_text, want_samples = expected(messages, 3, max_tokens=12)
    assert text == want_text
    assert_same_audio(samples, want_samples)
    assert fed_chunks(topo) >= before + 4  # the answer went on in chunks


# Last: the killed thinker's pod is gone for the rest of the module (no supervisor restarts it).
def test_a_thinker_killed_mid_answer_is_replayed_with_the_same_answers(topo: Topology) -> None:
    seeds = (5, 6, 7)
    results = answers_while_killing(topo, 0, lambda seed: chat(topo, TEXT, seed, 24), seeds)
    for seed in seeds:
        got = results[seed]
        assert not isinstance(got, Exception), got
        want_text, want_samples = expected(TEXT, seed, max_tokens=24)
        assert got[0] == want_text
        assert_same_audio(got[1], want_samples)
