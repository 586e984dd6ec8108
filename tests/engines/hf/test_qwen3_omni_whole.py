"""qwen3-omni served 1:2:1 with ``async_chunk`` off (each stage hands its whole output on):
chat's text and every PCM16 sample equal transformers' monolithic ``generate`` bit for bit."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.engines.hf.omni_reference import expected, wav_samples
from tests.sidecar.topology import Topology

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

PIPELINE = "qwen3-omni"


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    log_dir = tmp_path_factory.mktemp("qwen3-omni-whole")
    overlay = log_dir / "whole.yaml"
    overlay.write_text(f"base_config: {bundled_deploy_path(PIPELINE)}\nasync_chunk: false\n")
    top = Topology(PIPELINE, [1, 2, 1], log_dir, extra_stage_args=["--deploy-config", str(overlay)])
    try:
        top.start()
        for stage_id, count in enumerate(top.replicas):
            top.wait_discovered(stage_id, count, timeout=120)
        yield top
    finally:
        top.close()


def test_whole_answers_equal_the_monolithic_model_bit_for_bit(topo: Topology) -> None:
    sdk = openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "hello, who are you?"}]
    for seed in (3, 4):
        out = sdk.chat.completions.create(
            model=PIPELINE,
            messages=messages,  # type: ignore[arg-type]
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"},
            seed=seed,
            max_tokens=6,
        )
        message = out.choices[0].message
        assert message.audio is not None
        text, samples = expected(messages, seed, max_tokens=6)
        assert message.content == text
        assert np.array_equal(wav_samples(base64.b64decode(message.audio.data)), samples)
