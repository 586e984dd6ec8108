"""The deploy schema on its own: defaults, bounds, engine_extras, helpers, cross-field checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omni_mesh.configs.deploy import (
    ConfigIssue,
    ConnectorSpec,
    DeployConfig,
    DeployConfigError,
    StageDeployConfig,
)

pytestmark = pytest.mark.unit


def test_stage_defaults() -> None:
    s = StageDeployConfig(stage_id=0)
    assert (s.num_replicas, s.max_num_seqs, s.max_inflight, s.output_bytes) == (1, 8, 64, 64)
    assert s.devices is None and s.device_ids == () and s.world_size == 1
    assert s.engine_extras == {}


def test_unknown_stage_keys_are_refused_and_engine_extras_take_free_keys() -> None:
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        StageDeployConfig.model_validate({"stage_id": 1, "max_num_batched_tokens": 512})
    s = StageDeployConfig.model_validate({"stage_id": 1, "engine_extras": {"a": 1, "b": 2}})
    assert s.engine_extras == {"a": 1, "b": 2}


def test_pipeline_wide_key_inside_a_stage_is_an_error() -> None:
    with pytest.raises(ValidationError, match="trust_remote_code: pipeline-wide"):
        StageDeployConfig.model_validate({"stage_id": 0, "trust_remote_code": True})


def test_world_size_prefers_local_data_parallel_size() -> None:
    s = StageDeployConfig(
        stage_id=0, tensor_parallel_size=2, pipeline_parallel_size=3, data_parallel_size=4
    )
    assert s.world_size == 24
    local = s.model_copy(update={"data_parallel_size_local": 2})
    assert local.world_size == 12


@pytest.mark.parametrize(
    ("given", "normalized"),
    [("0,1,2,3", "0,1,2,3"), ("0, 1", "0,1"), (3, "3"), ([4, 5], "4,5"), ("07", "7")],
)
def test_devices_are_normalized(given: object, normalized: str) -> None:
    s = StageDeployConfig.model_validate(
        {"stage_id": 0, "devices": given, "num_replicas": len(normalized.split(","))}
    )
    assert s.devices == normalized


@pytest.mark.parametrize("bad", ["", "a,b", "0,,1", "0,0", "-1", True])
def test_bad_devices_are_rejected(bad: object) -> None:
    with pytest.raises(ValidationError, match="devices"):
        StageDeployConfig.model_validate({"stage_id": 0, "devices": bad})


def test_replica_devices_split_the_pool() -> None:
    s = StageDeployConfig(stage_id=1, devices="0,1,2,3", tensor_parallel_size=2, num_replicas=2)
    assert s.replica_devices(0) == (0, 1) and s.replica_devices(1) == (2, 3)
    with pytest.raises(ValueError, match="no replica slot 2"):
        s.replica_devices(2)


def test_standbys_and_a_prefill_pool_have_device_slots_of_their_own() -> None:
    s = StageDeployConfig.model_validate(
        {
            "stage_id": 1,
            "devices": "0,1,2,3,4",
            "num_replicas": 1,
            "autoscale": {"min_replicas": 1, "max_replicas": 3, "standby_replicas": 1},
            "prefill": {"num_replicas": 1},
        }
    )
    assert s.device_slots == 5  # 3 (largest pool) + 1 standby + 1 prefill
    assert [s.replica_devices(i) for i in range(5)] == [(0,), (1,), (2,), (3,), (4,)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stage_id", 64),
        ("num_replicas", 0),
        ("num_replicas", 257),
        ("max_num_seqs", 4097),
        ("max_inflight", 0),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("step_latency_ms", -1),
        ("per_item_latency_ms", 60_001),
        ("output_bytes", (1 << 30) + 1),
        ("output_chunks", 0),
        ("output_chunks", 1025),
        ("dtype", "fp7"),
        ("tensor_parallel_size", 0),
    ],
)
def test_stage_bounds(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        StageDeployConfig.model_validate({"stage_id": 0, field: value})


def test_connector_keys_must_name_edges() -> None:
    with pytest.raises(ValidationError, match="from_stage_N"):
        StageDeployConfig.model_validate({"stage_id": 1, "input_connectors": {"stage0": "shm"}})
    s = StageDeployConfig.model_validate(
        {"stage_id": 1, "input_connectors": {"from_stage_0": "shm"}, "output_connectors": {}}
    )
    assert s.input_connector(0) == "shm" and s.input_connector(2) is None
    assert s.output_connector(2) is None


def test_connector_spec() -> None:
    spec = ConnectorSpec.model_validate({"name": "HttpConnector", "extra": {"timeout": 5}})
    assert spec.extra == {"timeout": 5}
    with pytest.raises(ValidationError):
        ConnectorSpec.model_validate({"name": "RdmaConnector"})
    with pytest.raises(ValidationError):
        ConnectorSpec.model_validate({"name": "HttpConnector", "extra": {"k": [1, 2]}})


def _two_stage(out: str | None, inp: str | None) -> DeployConfig:
    stages: list[dict[str, object]] = [{"stage_id": 0}, {"stage_id": 1}]
    if out:
        stages[0]["output_connectors"] = {"to_stage_1": out}
    if inp:
        stages[1]["input_connectors"] = {"from_stage_0": inp}
    connectors = {"shm": {"name": "SharedMemoryConnector"}, "http": {"name": "HttpConnector"}}
    return DeployConfig.model_validate({"connectors": connectors, "stages": stages})


def test_connector_for_edge() -> None:
    assert _two_stage(None, None).connector_for_edge(0, 1).name == "SharedMemoryConnector"
    assert _two_stage("http", None).connector_for_edge(0, 1).name == "HttpConnector"
    assert _two_stage(None, "http").connector_for_edge(0, 1).name == "HttpConnector"
    assert _two_stage("http", "http").connector_name_for_edge(0, 1) == "http"


def test_connector_disagreement_is_rejected() -> None:
    with pytest.raises(ValidationError, match="receiver names connector 'http'"):
        _two_stage("shm", "http")


def test_stage_lookup_applies_pipeline_wide_sizes() -> None:
    cfg = DeployConfig.model_validate(
        {"tensor_parallel_size": 2, "dtype": "bfloat16", "stages": [{"stage_id": 0}]}
    )
    assert cfg.stage(0).tensor_parallel_size == 2
    assert cfg.stage(0).dtype == "bfloat16"
    absent = cfg.stage(5)
    assert (absent.stage_id, absent.tensor_parallel_size, absent.max_num_seqs) == (5, 2, 8)


def test_a_stage_setting_beats_the_pipeline_wide_one() -> None:
    cfg = DeployConfig.model_validate(
        {"data_parallel_size": 4, "stages": [{"stage_id": 0, "data_parallel_size": 1}]}
    )
    assert cfg.stage(0).data_parallel_size == 1


def test_direct_construction_checks_devices() -> None:
    with pytest.raises(ValidationError, match=r"stage 0 lists 1 device\(s\)"):
        DeployConfig.model_validate(
            {"stages": [{"stage_id": 0, "devices": "0", "tensor_parallel_size": 2}]}
        )


def test_duplicate_stage_ids() -> None:
    with pytest.raises(ValidationError, match=r"stages\[stage_id=1\]: stage 1 is listed more"):
        DeployConfig.model_validate({"stages": [{"stage_id": 1}, {"stage_id": 1}]})


def test_deploy_config_error_lists_every_issue() -> None:
    err = DeployConfigError(
        [
            ConfigIssue("stages[stage_id=1].devices", "too few", 1, "devices", "a.yaml"),
            ConfigIssue("connectors", "bad", source="b.yaml"),
        ]
    )
    assert str(err) == "a.yaml: stages[stage_id=1].devices: too few\nb.yaml: connectors: bad"
    assert isinstance(err, ValueError) and err.issues[0].stage_id == 1
