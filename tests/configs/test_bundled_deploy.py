"""The deploy YAMLs shipped in omni_mesh/configs/deploy load for their pipelines."""

from __future__ import annotations

import pytest

from omni_mesh.configs.loader import (
    BUNDLED_DIR,
    DeployConfigError,
    bundled_deploy_path,
    load_deploy_config,
    read_yaml,
)
from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.configs.registry import get_pipeline, list_pipelines

pytestmark = pytest.mark.unit

BUNDLED = (
    "tiny-omni",
    "tiny-tts",
    "tiny-image",
    "synthetic",
    "synthetic-diamond",
    "qwen3-omni",
    "csm-tts",
    "glm-image",
)
HF_MODELS = {  # transformers (and diffusers) pipelines
    "qwen3-omni": "tiny-qwen3-omni",
    "csm-tts": "tiny-csm",
    "glm-image": "tiny-glm-image",
}
VLLM_BUNDLED = ("tiny-llm", "tiny-omni-vllm")  # tests/configs/test_vllm_stage_fields.py


def test_every_bundled_yaml_names_a_registered_pipeline() -> None:
    names = {p.stem for p in BUNDLED_DIR.glob("*.yaml")}
    assert names == {*BUNDLED, *VLLM_BUNDLED} and names <= set(list_pipelines())


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_yaml_loads(name: str) -> None:
    pipeline = get_pipeline(name)
    cfg = load_deploy_config(None, pipeline)
    assert cfg == load_deploy_config(bundled_deploy_path(name), pipeline)
    assert cfg.pipeline == name
    assert [s.stage_id for s in cfg.stages] == sorted(pipeline.stage_ids)
    assert set(cfg.connectors) == {"shm", "http"}
    for stage in pipeline.stages:
        for src in stage.sources:
            assert cfg.connector_name_for_edge(src, stage.stage_id) == "shm"
    for s in cfg.stages:
        assert s.devices is None  # CPU reference engines
        assert "max_num_seqs" in _raw_stage(name, s.stage_id)
        if name in HF_MODELS:  # every stage loads its part of the same folder
            assert s.engine_extras["model"] == HF_MODELS[name]
        else:
            assert s.engine_extras == {}


@pytest.mark.parametrize("name", BUNDLED)
def test_every_platform_section_validates(name: str) -> None:
    pipeline = get_pipeline(name)
    for platform in load_deploy_config(None, pipeline).platforms:
        cfg = load_deploy_config(None, pipeline, platform=platform)
        assert all(s.devices is None or len(s.device_ids) == s.world_size for s in cfg.stages)


def test_tiny_omni_cuda_platform() -> None:
    cfg = load_deploy_config(None, get_pipeline("tiny-omni"), platform="cuda")
    assert [s.devices for s in cfg.stages] == ["0", "1", "1"]
    assert {s.dtype for s in cfg.stages} == {"bfloat16"}


def test_synthetic_is_a_no_op() -> None:
    cfg = load_deploy_config(None, get_pipeline("synthetic"))
    for s in cfg.stages:
        assert (s.step_latency_ms, s.per_item_latency_ms, s.output_bytes) == (0.0, 0.0, 64)


def test_bundled_path_errors() -> None:
    with pytest.raises(DeployConfigError, match=r"invalid pipeline name '\.\./etc'"):
        bundled_deploy_path("../etc")
    with pytest.raises(DeployConfigError, match="no bundled deploy config for pipeline 'nope'"):
        bundled_deploy_path("nope")


def test_pipeline_without_bundled_yaml_gets_defaults(chain3: PipelineSpec) -> None:
    cfg = load_deploy_config(None, chain3, stage_overrides='{"2": {"num_replicas": 2}}')
    assert [(s.stage_id, s.num_replicas) for s in cfg.stages] == [(0, 1), (1, 1), (2, 2)]


def _raw_stage(name: str, stage_id: int) -> dict[str, object]:
    raw = read_yaml(bundled_deploy_path(name), name)
    return next(s for s in raw["stages"] if s["stage_id"] == stage_id)
