"""A vLLM stage's ``engine_args`` and ``sampling`` in the deploy config: bundled YAMLs, the
override layers reaching them (deep-merged), bad values named."""

from __future__ import annotations

import json

import pytest

from omni_mesh.configs.loader import DeployConfigError, load_deploy_config
from omni_mesh.configs.registry import get_pipeline

from .helpers import WriteYaml

pytestmark = pytest.mark.unit


def test_bundled_tiny_llm() -> None:
    (stage,) = load_deploy_config(None, get_pipeline("tiny-llm")).stages
    assert stage.engine_args == {
        "model": "tiny-llama-text",
        "seed": 0,
        "kv_cache_memory_bytes": 1 << 30,
    }
    assert (stage.sampling.temperature, stage.sampling.max_tokens) == (0.8, 64)
    assert stage.max_model_len == 512
    assert stage.engine_extras == {"chunk_tokens": 1, "chat_template": False}
    assert load_deploy_config(None, get_pipeline("tiny-llm")).async_chunk  # token by token


def test_bundled_tiny_omni_vllm() -> None:
    cfg = load_deploy_config(None, get_pipeline("tiny-omni-vllm"))
    thinker, talker, code2wav = cfg.stages
    assert thinker.engine_args["model"] == "tiny-llama-text"
    assert talker.engine_args == {
        "model": "tiny-llama-codec",
        "skip_tokenizer_init": True,
        "seed": 0,
        "kv_cache_memory_bytes": 1 << 30,
    }
    assert talker.engine_extras["chunk_tokens"] % 4 == 0  # whole codec frames per chunk
    assert code2wav.engine_args == {}
    assert cfg.connector_name_for_edge(0, 1) == "shm"


def test_stage_overrides_merge_into_engine_args_and_sampling() -> None:
    overrides = {
        "0": {
            "engine_args": {"model": "/models/real"},
            "sampling": {"temperature": 0.1, "stop": ["\n"]},
        }
    }
    (stage,) = load_deploy_config(
        None, get_pipeline("tiny-llm"), stage_overrides=json.dumps(overrides)
    ).stages
    assert stage.engine_args["model"] == "/models/real"
    assert stage.engine_args["seed"] == 0  # kept from the YAML: overrides merge key by key
    assert stage.sampling.temperature == 0.1
    assert stage.sampling.max_tokens == 64
    assert stage.sampling.stop == ("\n",)


def test_flags_reach_the_stage_fields_vllm_reads() -> None:
    (stage,) = load_deploy_config(
        None, get_pipeline("tiny-llm"), cli_overrides={"max_model_len": 256, "max_num_seqs": 4}
    ).stages
    assert (stage.max_model_len, stage.max_num_seqs) == (256, 4)


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        ("{top_p: 2.0}", "top_p"),
        ("{temperature: -1}", "temperature"),
        ("{max_tokens: 0}", "max_tokens"),
        ("{nucleus: 0.5}", "nucleus"),
    ],
)
def test_bad_stage_sampling_is_named(write_yaml: WriteYaml, sampling: str, needle: str) -> None:
    path = write_yaml(
        "bad.yaml",
        f"""
        pipeline: tiny-llm
        stages:
          - stage_id: 0
            sampling: {sampling}
        """,
    )
    with pytest.raises(DeployConfigError) as info:
        load_deploy_config(path, get_pipeline("tiny-llm"))
    assert f"sampling.{needle}" in str(info.value)
