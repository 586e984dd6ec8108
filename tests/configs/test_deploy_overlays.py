"""base_config overlays: deep merge, stages by stage_id, relative paths, cycles."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_mesh.configs.loader import DeployConfigError, load_deploy_config
from omni_mesh.configs.pipeline_spec import PipelineSpec

from .helpers import WriteYaml

pytestmark = pytest.mark.unit

BASE = """
    async_chunk: true
    connectors:
      shm: {name: SharedMemoryConnector}
      http: {name: HttpConnector, extra: {timeout_s: 5, retries: 1}}
    stages:
      - stage_id: 0
        max_num_seqs: 32
        output_connectors: {to_stage_1: shm}
        engine_extras: {sampler: {top_k: 5, top_p: 0.9}, stop: [1, 2]}
      - stage_id: 1
        max_num_seqs: 16
        gpu_memory_utilization: 0.7
        input_connectors: {from_stage_0: shm}
"""


def test_overlay_merges_deeply(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    base = write_yaml("base.yaml", BASE)
    overlay = write_yaml(
        "overlay.yaml",
        f"""
        base_config: {base}
        connectors:
          http: {{extra: {{timeout_s: 30}}}}
        stages:
          - stage_id: 0
            engine_extras: {{sampler: {{top_k: 50}}, stop: [3]}}
          - stage_id: 2
            max_num_seqs: 4
        """,
    )
    cfg = load_deploy_config(overlay, chain3)
    assert cfg.async_chunk is True  # inherited
    assert cfg.connectors["http"].extra == {"timeout_s": 30, "retries": 1}  # mapping: deep merge
    s0 = cfg.stage(0)
    assert s0.max_num_seqs == 32 and s0.output_connector(1) == "shm"
    assert s0.engine_extras == {
        "sampler": {"top_k": 50, "top_p": 0.9},
        "stop": [3],
    }  # list: replace
    assert cfg.stage(1).gpu_memory_utilization == 0.7
    assert cfg.stage(2).max_num_seqs == 4  # new stage from the overlay
    assert [s.stage_id for s in cfg.stages] == [0, 1, 2]


def test_unknown_keys_in_different_layers_merge(
    write_yaml: WriteYaml, chain3: PipelineSpec
) -> None:
    write_yaml("base.yaml", "stages: [{stage_id: 0, engine_extras: {foo: 1, bar: 2}}]")
    top = write_yaml(
        "top.yaml", "base_config: base.yaml\nstages: [{stage_id: 0, engine_extras: {bar: 3}}]"
    )
    assert load_deploy_config(top, chain3).stage(0).engine_extras == {"foo": 1, "bar": 3}


def test_relative_base_resolves_against_the_overlay_folder(
    write_yaml: WriteYaml, chain3: PipelineSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_yaml("conf/bases/base.yaml", "stages: [{stage_id: 1, max_num_seqs: 3}]")
    write_yaml("conf/mid.yaml", "base_config: bases/base.yaml\nhop_retries: 5")
    write_yaml(
        "conf/site/top.yaml", "base_config: ../mid.yaml\nstages: [{stage_id: 1, num_replicas: 2}]"
    )
    monkeypatch.chdir(tmp_path)  # not the overlay's folder
    cfg = load_deploy_config(Path("conf/site/top.yaml"), chain3)
    assert (cfg.hop_retries, cfg.stage(1).max_num_seqs, cfg.stage(1).num_replicas) == (5, 3, 2)


def test_overlay_cycle_is_reported(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    write_yaml("a.yaml", "base_config: b.yaml")
    write_yaml("b.yaml", "base_config: c.yaml")
    c = write_yaml("c.yaml", "base_config: a.yaml")
    with pytest.raises(
        DeployConfigError, match=r"base_config: overlay cycle: .*a\.yaml -> .*a\.yaml"
    ):
        load_deploy_config(c.parent / "a.yaml", chain3)


def test_self_reference_is_a_cycle(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    me = write_yaml("me.yaml", "base_config: me.yaml")
    with pytest.raises(DeployConfigError, match="cycle"):
        load_deploy_config(me, chain3)


def test_missing_base_names_the_overlay(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    top = write_yaml("top.yaml", "base_config: nowhere.yaml")
    with pytest.raises(DeployConfigError, match=r"top\.yaml: base_config: .*nowhere\.yaml"):
        load_deploy_config(top, chain3)


def test_base_config_must_be_a_path(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    top = write_yaml("top.yaml", "base_config: [a, b]")
    with pytest.raises(DeployConfigError, match=r"top\.yaml: base_config: must be the path"):
        load_deploy_config(top, chain3)


def test_overlay_depth_is_bounded(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    write_yaml("f0.yaml", "hop_retries: 1")
    for i in range(1, 12):
        write_yaml(f"f{i}.yaml", f"base_config: f{i - 1}.yaml")
    with pytest.raises(DeployConfigError, match="nested base_config"):
        load_deploy_config(write_yaml("f12.yaml", "base_config: f11.yaml"), chain3)


def test_errors_name_the_file_that_holds_the_bad_value(
    write_yaml: WriteYaml, chain3: PipelineSpec
) -> None:
    write_yaml("base.yaml", "stages: [{stage_id: 2, max_num_seqs: 100000}]")
    top = write_yaml("top.yaml", "base_config: base.yaml")
    with pytest.raises(DeployConfigError) as info:
        load_deploy_config(top, chain3)
    assert "base.yaml: stages[stage_id=2].max_num_seqs: Input should be less than" in str(
        info.value
    )
    assert "top.yaml" not in str(info.value)
