"""Stage flags: derived from the model, None unless given, validated, round trip to the loader."""

from __future__ import annotations

import argparse
import re

import pytest

from omni_mesh.configs.cli_flags import (
    STAGE_FLAG_FIELDS,
    add_stage_flags,
    cli_overrides_from_args,
    flag_name,
)
from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.pipeline_spec import PipelineSpec

from .helpers import WriteYaml

pytestmark = pytest.mark.unit


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-stage", exit_on_error=False)
    add_stage_flags(p)
    return p


def test_every_flag_is_a_stage_field(parser: argparse.ArgumentParser) -> None:
    assert set(STAGE_FLAG_FIELDS) <= set(StageDeployConfig.model_fields)
    help_text = parser.format_help()
    for name in STAGE_FLAG_FIELDS:
        assert flag_name(name) in help_text
    assert "1 <= x <= 4096; default 8" in " ".join(help_text.split())


def test_nothing_given_means_no_overrides(parser: argparse.ArgumentParser) -> None:
    assert cli_overrides_from_args(parser.parse_args([])) == {}


def test_round_trip(
    parser: argparse.ArgumentParser, write_yaml: WriteYaml, chain3: PipelineSpec
) -> None:
    argv = [
        "--num-replicas=2",
        "--max-num-seqs=16",
        "--max-inflight=100",
        "--tensor-parallel-size=2",
        "--pipeline-parallel-size=1",
        "--data-parallel-size=1",
        "--gpu-memory-utilization=0.5",
        "--max-model-len=16384",
        "--no-enforce-eager",
        "--dtype=bfloat16",
        "--devices=0, 1, 2, 3",
        "--step-latency-ms=2.5",
        "--per-item-latency-ms=0.25",
        "--output-bytes=4096",
        "--output-chunks=4",
    ]
    overrides = cli_overrides_from_args(parser.parse_args(argv))
    assert set(overrides) == set(STAGE_FLAG_FIELDS)
    assert overrides["devices"] == "0,1,2,3" and overrides["enforce_eager"] is False
    cfg = load_deploy_config(
        write_yaml("x.yaml", "stages: [{stage_id: 1, max_num_seqs: 2}]"),
        chain3,
        cli_overrides=overrides,
        target_stages=[1],
    )
    s = cfg.stage(1)
    assert s.model_dump(include=set(STAGE_FLAG_FIELDS)) == overrides
    assert s.replica_devices(1) == (2, 3)
    assert cfg.stage(0).max_num_seqs == 8  # not a target


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--max-num-seqs", "5000"], "Input should be less than or equal to 4096 (got '5000')"),
        (["--max-num-seqs", "many"], "Input should be a valid integer"),
        (["--gpu-memory-utilization", "0"], "Input should be greater than 0"),
        (["--devices", "0;1"], "devices must be comma-separated"),
        (["--dtype", "fp7"], "Input should be 'auto', 'half'"),
    ],
)
def test_bad_values_fail_at_parse_time(
    parser: argparse.ArgumentParser, argv: list[str], expected: str
) -> None:
    with pytest.raises(argparse.ArgumentError, match=re.escape(expected)) as info:
        parser.parse_args(argv)
    assert flag_name(argv[0].lstrip("-").replace("-", "_")) in str(info.value)
