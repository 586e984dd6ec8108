"""qwen3-omni served 1:2:1 with ``async_chunk`` off (each stage hands its whole output on):
chat's text and every PCM16 sample equal transformers' monolithic ``generate`` bit for bit, and
so does ``/v1/run`` called stage by stage (thinker, talker, code2wav, each call's opaque
``stage_input`` fed to the next)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.engines.qwen3_omni.omni_reference import expected, wav_samples
from tests.sidecar.topology import Topology, post_json

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
    with openai.OpenAI(base_url=f"{topo.api_url}/v1", api_key="none", max_retries=0) as sdk:
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
