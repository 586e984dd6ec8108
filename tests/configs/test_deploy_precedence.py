"""Precedence: --stage-overrides > CLI flags > platform section > overlay > base > defaults."""

from __future__ import annotations

import argparse
import json

import pytest

from omni_mesh.configs.cli_flags import add_stage_flags, cli_overrides_from_args
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.pipeline_spec import PipelineSpec

from .helpers import WriteYaml

pytestmark = pytest.mark.unit

# The bundled qwen3_omni_moe.yaml excerpt of the seed doc's worked example.
QWEN3_BASE = """
    async_chunk: true
    stages:
      - stage_id: 0
        gpu_memory_utilization: 0.9
        max_num_seqs: 32
      - stage_id: 1
        gpu_memory_utilization: 0.7
        max_num_seqs: 16
"""


def test_worked_override_example(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    base = write_yaml("deploy/qwen3_omni_moe.yaml", QWEN3_BASE)
    overlay = write_yaml(
        "my_overrides.yaml",
        f"""
        base_config: {base}
        stages:
          - stage_id: 1
            gpu_memory_utilization: 0.5     # smaller GPU
        """,
    )
    parser = argparse.ArgumentParser()
    add_stage_flags(parser)
    parser.add_argument("--stage-overrides")
    args = parser.parse_args(
        ["--max-model-len", "16384", "--stage-overrides", '{"0": {"max_num_seqs": 8}}']
    )
    cfg = load_deploy_config(
        overlay,
        chain3,
        cli_overrides=cli_overrides_from_args(args),
        stage_overrides=args.stage_overrides,
    )
    s0, s1 = cfg.stage(0), cfg.stage(1)
    assert (s0.gpu_memory_utilization, s0.max_num_seqs, s0.max_model_len) == (0.9, 8, 16384)
    assert (s1.gpu_memory_utilization, s1.max_num_seqs, s1.max_model_len) == (0.5, 16, 16384)
    assert cfg.async_chunk is True


def _layers(write_yaml: WriteYaml, levels: int) -> dict[str, object]:
    """Set max_num_seqs (stage 0) at the first ``levels`` levels, each to a different value:
    base=11, overlay=12, platform=13, CLI=14, stage-overrides=15."""
    write_yaml("base.yaml", "stages: [{stage_id: 0, max_num_seqs: 11}]")
    overlay = "base_config: base.yaml\n"
    if levels >= 2:
        overlay += "stages: [{stage_id: 0, max_num_seqs: 12}]\n"
    if levels >= 3:
        overlay += "platforms: {npu: {stages: [{stage_id: 0, max_num_seqs: 13}]}}\n"
    return {
        "path": write_yaml("overlay.yaml", overlay),
        "platform": "npu",
        "cli_overrides": {"max_num_seqs": 14} if levels >= 4 else None,
        "stage_overrides": {"0": {"max_num_seqs": 15}} if levels >= 5 else None,
    }


@pytest.mark.parametrize("levels", [1, 2, 3, 4, 5])
def test_each_level_beats_the_one_below(
    write_yaml: WriteYaml, chain3: PipelineSpec, levels: int
) -> None:
    kw = _layers(write_yaml, levels)
    cfg = load_deploy_config(kw.pop("path"), chain3, **kw)  # type: ignore[arg-type]
    assert cfg.stage(0).max_num_seqs == 10 + levels
    assert cfg.stage(1).max_num_seqs == (14 if levels >= 4 else 8)  # CLI reaches every stage


def test_defaults_fill_what_no_layer_sets(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    cfg = load_deploy_config(write_yaml("empty.yaml", ""), chain3)
    assert [s.stage_id for s in cfg.stages] == [0, 1, 2]
    assert cfg.stage(2).max_num_seqs == 8 and cfg.request_timeout_s == 120.0
    assert cfg.pipeline == "chain3"


def test_platform_selection(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    path = write_yaml(
        "p.yaml",
        """
        dtype: float16
        stages: [{stage_id: 0, max_num_seqs: 4}]
        platforms:
          cuda:
            dtype: bfloat16
            stages: [{stage_id: 0, devices: "0"}]
          npu:
            hop_retries: 0
            stages: [{stage_id: 0, devices: "3", max_num_seqs: 2}]
        """,
    )
    none = load_deploy_config(path, chain3)
    assert (none.dtype, none.stage(0).devices, none.stage(0).max_num_seqs) == ("float16", None, 4)
    cuda = load_deploy_config(path, chain3, platform="cuda")
    assert (cuda.dtype, cuda.stage(0).devices, cuda.stage(0).max_num_seqs) == ("bfloat16", "0", 4)
    assert cuda.stage(1).dtype == "bfloat16"  # pipeline-wide dtype reaches every stage
    npu = load_deploy_config(path, chain3, platform="npu")
    assert (npu.hop_retries, npu.stage(0).devices, npu.stage(0).max_num_seqs) == (0, "3", 2)
    other = load_deploy_config(path, chain3, platform="rocm")  # no section: base settings
    assert other.stage(0).devices is None


def test_cli_flags_target_stages(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    cfg = load_deploy_config(
        write_yaml("x.yaml", ""), chain3, cli_overrides={"max_num_seqs": 2}, target_stages=[1]
    )
    assert [cfg.stage(i).max_num_seqs for i in (0, 1, 2)] == [8, 2, 8]


def test_pipeline_wide_cli_key_sets_top_level(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    cfg = load_deploy_config(
        write_yaml("x.yaml", "hop_retries: 1"),
        chain3,
        cli_overrides={"hop_retries": 4, "trust_remote_code": True, "max_num_seqs": 3},
        target_stages=[0],
    )
    assert (cfg.hop_retries, cfg.trust_remote_code) == (4, True)
    assert (cfg.stage(0).max_num_seqs, cfg.stage(1).max_num_seqs) == (3, 8)


def test_cli_tensor_parallel_beats_yaml_stage_value(
    write_yaml: WriteYaml, chain3: PipelineSpec
) -> None:
    path = write_yaml(
        "x.yaml", "tensor_parallel_size: 4\nstages: [{stage_id: 0, tensor_parallel_size: 2}]"
    )
    assert load_deploy_config(path, chain3).stage(0).tensor_parallel_size == 2  # stage beats top
    assert load_deploy_config(path, chain3).stage(1).tensor_parallel_size == 4  # top fills
    cfg = load_deploy_config(path, chain3, cli_overrides={"tensor_parallel_size": 1})
    assert [s.tensor_parallel_size for s in cfg.stages] == [1, 1, 1]


def test_stage_overrides_accepts_json_and_mappings(
    write_yaml: WriteYaml, chain3: PipelineSpec
) -> None:
    path = write_yaml("x.yaml", "")
    over = {"2": {"num_replicas": 3, "engine_extras": {"foo": "bar"}}}
    from_text = load_deploy_config(path, chain3, stage_overrides=json.dumps(over))
    from_map = load_deploy_config(path, chain3, stage_overrides=over)
    assert from_text == from_map
    assert from_text.stage(2).num_replicas == 3 and from_text.stage(2).engine_extras == {
        "foo": "bar"
    }


def test_stage_overrides_fix_a_broadcast_tensor_parallel_size(
    write_yaml: WriteYaml, chain3: PipelineSpec
) -> None:
    path = write_yaml(
        "x.yaml", 'stages: [{stage_id: 0, devices: "0"}, {stage_id: 1, devices: "1,2"}]'
    )
    cfg = load_deploy_config(
        path,
        chain3,
        cli_overrides={"tensor_parallel_size": 2},
        stage_overrides={"0": {"tensor_parallel_size": 1}},
    )
    assert [s.world_size for s in cfg.stages] == [1, 2, 2]
