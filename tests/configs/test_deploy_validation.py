"""Every load-time error is a DeployConfigError naming the source, the field path and the stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omni_mesh.configs.loader import DeployConfigError, load_deploy_config
from omni_mesh.configs.pipeline_spec import PipelineSpec

from .helpers import WriteYaml

pytestmark = pytest.mark.unit

CONNECTORS = "connectors: {shm: {name: SharedMemoryConnector}, http: {name: HttpConnector}}\n"


def _error(path: Path | str | None, pipeline: PipelineSpec, **kw: Any) -> DeployConfigError:
    with pytest.raises(DeployConfigError) as info:
        load_deploy_config(path, pipeline, **kw)
    return info.value


def test_message_style(
    write_yaml: WriteYaml, chain3: PipelineSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_yaml("my.yaml", "stages: [{stage_id: 1, max_num_seqs: 5000}]")
    monkeypatch.chdir(tmp_path)
    err = _error("my.yaml", chain3)
    assert str(err).startswith(
        "my.yaml: stages[stage_id=1].max_num_seqs: Input should be less than or equal to 4096"
    )
    (issue,) = err.issues
    assert (issue.source, issue.stage_id, issue.path) == (
        "my.yaml",
        1,
        "stages[stage_id=1].max_num_seqs",
    )


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        (
            "stages: [{stage_id: 0, num_replicas: many}]",
            "stages[stage_id=0].num_replicas: Input should be a valid integer",
        ),
        (
            "stages: [{stage_id: 2, gpu_memory_utilization: 1.2}]",
            "stages[stage_id=2].gpu_memory_utilization: Input should be less than or equal to 1",
        ),
        ("stages: [{stage_id: 1, dtype: fp7}]", "stages[stage_id=1].dtype: Input should be"),
        (
            'stages: [{stage_id: 1, devices: "0;1"}]',
            "stages[stage_id=1].devices: devices must be comma-separated",
        ),
        (
            "stages: [{stage_id: 1, input_connectors: {stage_0: shm}}]",
            "stages[stage_id=1].input_connectors.stage_0: keys are 'from_stage_N'",
        ),
        (
            "stages: [{stage_id: 0, trust_remote_code: true}]",
            "stages[stage_id=0]: trust_remote_code: pipeline-wide setting",
        ),
        ("stages: [{max_num_seqs: 4}]", "stages[0].stage_id: Field required"),
        ("stages: [{stage_id: 1}, {stage_id: 1}]", "stages[stage_id=1]: stage 1 is listed more"),
        ("max_num_seq: 4", "max_num_seq: unknown key (did you mean 'max_num_seqs'?)"),
        ("hop_retries: 11", "hop_retries: Input should be less than or equal to 10"),
        ("request_timeout_s: 0", "request_timeout_s: Input should be greater than or equal to 0.1"),
        ("distributed_executor_backend: slurm", "distributed_executor_backend: Input should be"),
        ("connectors: {x: {name: RdmaConnector}}", "connectors.x.name: Input should be"),
        (
            "connectors: {x: {name: HttpConnector, extra: {k: [1]}}}",
            "connectors.x.extra.k: Input should be a valid string",
        ),
        (
            'platforms: {cuda: {stages: [{stage_id: 2, devices: "a"}]}}',
            "platforms.cuda.stages[stage_id=2].devices: devices must be",
        ),
        ("platforms: {cuda: {max_num_seqs: 3}}", "platforms.cuda.max_num_seqs: unknown key"),
        ("pipeline: tiny-tts", "pipeline: this deploy config is for pipeline 'tiny-tts'"),
    ],
)
def test_field_errors(
    write_yaml: WriteYaml, chain3: PipelineSpec, yaml_text: str, expected: str
) -> None:
    err = str(_error(write_yaml("bad.yaml", yaml_text), chain3))
    assert "bad.yaml: " + expected in err


@pytest.mark.parametrize(
    ("yaml_text", "expected", "stage_id"),
    [
        ("stages: [{stage_id: 7}]", "stages[stage_id=7]: stage 7 is not in pipeline 'chain3'", 7),
        (
            "stages: [{stage_id: 0, output_connectors: {to_stage_1: rdma}}]",
            "stages[stage_id=0].output_connectors.to_stage_1: connector 'rdma' is not defined",
            0,
        ),
        (
            "stages: [{stage_id: 0, output_connectors: {to_stage_2: shm}}]",
            "stages[stage_id=0].output_connectors.to_stage_2: pipeline 'chain3' has no edge 0 -> 2",
            0,
        ),
        (
            "stages: [{stage_id: 1, input_connectors: {from_stage_2: shm}}]",
            "stages[stage_id=1].input_connectors.from_stage_2: pipeline 'chain3' has no edge 2 ->",
            1,
        ),
        (
            "stages: [{stage_id: 0, output_connectors: {to_stage_1: shm}},"
            " {stage_id: 1, input_connectors: {from_stage_0: http}}]",
            "stages[stage_id=1].input_connectors.from_stage_0: edge 0 -> 1: receiver names "
            "connector 'http' but sender stage 0 names 'shm'",
            1,
        ),
        (
            "stages: [{stage_id: 2, data_parallel_size: 2, data_parallel_size_local: 4}]",
            "stages[stage_id=2].data_parallel_size_local: 4 exceeds data_parallel_size 2",
            2,
        ),
        (
            "platforms: {npu: {stages: [{stage_id: 9}]}}",
            "platforms.npu.stages[stage_id=9]: stage 9 is not in pipeline",
            9,
        ),
    ],
)
def test_cross_field_errors(
    write_yaml: WriteYaml, chain3: PipelineSpec, yaml_text: str, expected: str, stage_id: int
) -> None:
    err = _error(write_yaml("bad.yaml", CONNECTORS + yaml_text), chain3)
    assert "bad.yaml: " + expected in str(err)
    assert err.issues[0].stage_id == stage_id


def test_connector_without_a_name_in_any_layer(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    path = write_yaml("bad.yaml", "connectors: {x: {extra: {a: 1}}}")
    assert "bad.yaml: connectors.x.name: Field required" in str(_error(path, chain3))


def test_devices_must_match_world_size(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    ok = write_yaml(
        "ok.yaml",
        'stages: [{stage_id: 1, devices: "0,1,2,3", tensor_parallel_size: 2, num_replicas: 2}]',
    )
    assert load_deploy_config(ok, chain3).stage(1).replica_devices(1) == (2, 3)
    bad = write_yaml("bad.yaml", 'stages: [{stage_id: 1, devices: "0,1,2", num_replicas: 2}]')
    err = _error(bad, chain3)
    msg = str(err)
    assert "bad.yaml: stages[stage_id=1].devices: stage 1 lists 3 device(s)" in msg
    assert "needs 2 = world_size 1" in msg and "num_replicas 2" in msg
    assert "--stage-overrides" in msg
    assert err.issues[0].stage_id == 1


def test_standbys_and_a_prefill_pool_need_devices_too(
    write_yaml: WriteYaml, chain3: PipelineSpec
) -> None:
    bad = write_yaml(
        "bad.yaml",
        'stages: [{stage_id: 1, devices: "0,1", num_replicas: 1, prefill: {num_replicas: 1},\n'
        "          autoscale: {min_replicas: 1, max_replicas: 2, standby_replicas: 1}}]",
    )
    msg = str(_error(bad, chain3))
    assert "lists 2 device(s) ('0,1') but needs 4" in msg
    assert (
        "(autoscale.max_replicas 2 + autoscale.standby_replicas 1 + prefill.num_replicas 1)" in msg
    )


def test_broadcast_tensor_parallel_size_blames_both_sources(
    write_yaml: WriteYaml, chain3: PipelineSpec
) -> None:
    path = write_yaml(
        "gpu.yaml", 'stages: [{stage_id: 0, devices: "0"}, {stage_id: 1, devices: "1,2"}]'
    )
    err = _error(path, chain3, cli_overrides={"tensor_parallel_size": 2})
    msg = str(err)
    assert "gpu.yaml: stages[stage_id=0].devices: stage 0 lists 1 device(s)" in msg
    assert "tensor_parallel_size set by command line" in msg
    assert "stage_id=1" not in msg  # stage 1 has 2 devices for tp 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- a\n- b\n", "bad.yaml: top level must be a mapping of settings, got list"),
        ("42\n", "got int"),
        ("stages: [ {stage_id: 0\n", "bad.yaml: line 2, column 1: invalid YAML"),
        ("a: 1\nb: [\n", "invalid YAML"),
        ("---\na: 1\n---\nb: 2\n", "invalid YAML"),
        (
            "hop_retries: 1\nstages: []\nhop_retries: 2\n",
            "bad.yaml: line 3: duplicate key 'hop_retries'",
        ),
        ("!!python/object:os.system {}\n", "invalid YAML"),
        ("1: 2\n", "non-string keys"),
    ],
)
def test_malformed_yaml(
    write_yaml: WriteYaml, chain3: PipelineSpec, text: str, expected: str
) -> None:
    assert expected in str(_error(write_yaml("bad.yaml", text), chain3))


def test_yaml_limits(write_yaml: WriteYaml, chain3: PipelineSpec, tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    assert "big.yaml: file is larger than the 1 MiB limit" in str(_error(big, chain3))
    bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    bomb += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    assert "more than 100000 YAML nodes" in str(
        _error(write_yaml("bomb.yaml", "\n".join(bomb)), chain3)
    )
    deep = write_yaml("deep.yaml", "a: " + "[" * 5000 + "]" * 5000)
    assert "deep.yaml" in str(_error(deep, chain3))
    assert "cannot read deploy config" in str(_error(tmp_path / "missing.yaml", chain3))
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"a: \xff\xfe")
    assert "bin.yaml: not UTF-8 text" in str(_error(binary, chain3))


def test_yaml_anchors_and_merge_keys_work(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    path = write_yaml(
        "anchors.yaml",
        """
        stages:
          - &common {stage_id: 0, max_num_seqs: 4, max_inflight: 32}
          - {<<: *common, stage_id: 1, max_num_seqs: 2}
        """,
    )
    cfg = load_deploy_config(path, chain3)
    assert (cfg.stage(1).max_num_seqs, cfg.stage(1).max_inflight) == (2, 32)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ('{"0": {', "--stage-overrides: invalid JSON at line 1, column"),
        ("[1, 2]", "--stage-overrides: must be a JSON object"),
        ('{"zero": {}}', "--stage-overrides: 'zero': keys are stage ids"),
        ('{"1": 5}', "--stage-overrides: stages[stage_id=1]: must be an object"),
        ('{"1": {"stage_id": 2}}', "--stage-overrides: stages[stage_id=1]: stage_id 2 contradicts"),
        (
            '{"1": {"max_num_seqs": 0}}',
            "--stage-overrides: stages[stage_id=1].max_num_seqs: Input should be greater than",
        ),
        ('{"9": {}}', "--stage-overrides: stages[stage_id=9]: stage 9 is not in pipeline"),
        ('{"1": {}, "1": {}}', "--stage-overrides: invalid JSON: duplicate key '1'"),
        ("[" * 100_000, "--stage-overrides: larger than"),
        ("[" * 20_000, "--stage-overrides: JSON nesting is too deep"),
    ],
)
def test_bad_stage_overrides(
    write_yaml: WriteYaml, chain3: PipelineSpec, overrides: str, expected: str
) -> None:
    path = write_yaml("ok.yaml", "")
    assert expected in str(_error(path, chain3, stage_overrides=overrides))


def test_bad_cli_overrides(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    path = write_yaml("ok.yaml", "")
    err = _error(path, chain3, cli_overrides={"max_num_seqs": 0}, target_stages=[2])
    assert "command line: stages[stage_id=2].max_num_seqs: Input should be greater" in str(err)
    err = _error(path, chain3, cli_overrides={"max_num_seqs": 2}, target_stages=[5])
    assert "command line: --stage-id: stage(s) [5] not in pipeline 'chain3'" in str(err)
    err = _error(path, chain3, cli_overrides={"connectors": {}})
    assert "command line: connectors: cannot be set" in str(err)
    err = _error(path, chain3, cli_overrides={"hop_retries": 99})
    assert "command line: hop_retries: Input should be less than" in str(err)


def test_misspelt_stage_key_is_an_error(write_yaml: WriteYaml, chain3: PipelineSpec) -> None:
    path = write_yaml("typo.yaml", "stages: [{stage_id: 1, max_num_seqz: 4}]")
    msg = str(_error(path, chain3))
    assert "stages[stage_id=1].max_num_seqz: unknown key (did you mean 'max_num_seqs'?)" in msg
    assert "free-form engine keys go under engine_extras:" in msg
    err = _error(write_yaml("ok.yaml", ""), chain3, stage_overrides={"0": {"max_num_seqz": 4}})
    assert "--stage-overrides: stages[stage_id=0].max_num_seqz: unknown key" in str(err)


def test_batch_that_never_fills_is_logged(
    write_yaml: WriteYaml, chain3: PipelineSpec, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_yaml("full.yaml", "stages: [{stage_id: 1, max_num_seqs: 100}]")
    with caplog.at_level("WARNING", logger="omni_mesh.configs.loader"):
        load_deploy_config(path, chain3)
    assert "stage=1 max_inflight=64 is below max_num_seqs=100" in caplog.text
