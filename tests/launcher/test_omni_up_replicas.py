"""``omni-up --replicas``: a starting count of 0 is allowed only for a stage whose autoscale policy
may scale it to zero (``min_replicas: 0``); elsewhere it is refused with exit code 2, naming the
stage. (The real start at 0 is in ``test_autoscale_actuator.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_mesh.launcher import cli as cli_up

pytestmark = pytest.mark.unit

DEPLOY = """\
pipeline: synthetic
stages:
  - stage_id: 1
    num_replicas: 1
    autoscale: {min_replicas: 0, max_replicas: 2}
  - stage_id: 2
    num_replicas: 1
    autoscale: {min_replicas: 1, max_replicas: 2}
"""


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(DEPLOY)
    return path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli_up.parse_args(argv, {})
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_stage_that_scales_to_zero_may_start_at_zero(deploy: Path) -> None:
    argv = ["--pipeline", "synthetic", "--deploy-config", str(deploy), "--replicas", "1:0:1"]
    config = cli_up.parse_args(argv, {})
    assert config.replicas == (1, 0, 1)
    assert config.autoscale[1].min_replicas == 0


def test_zero_is_refused_for_a_stage_without_autoscale(
    deploy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(["--pipeline", "synthetic", "--replicas", "1:0:1"], capsys)
    assert "--replicas: the count for stage 1 (s1) must be an integer from 1 to" in err
    err = _refused(["--pipeline", "synthetic", "--deploy-config", str(deploy),
                    "--replicas", "0:1:1"], capsys)  # fmt: skip
    assert "the count for stage 0 (s0) must be an integer from 1 to" in err


def test_zero_is_refused_for_an_autoscaled_stage_with_a_positive_minimum(
    deploy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--pipeline", "synthetic", "--deploy-config", str(deploy), "--replicas", "1:1:0"]
    assert "the count for stage 2 (s2) must be an integer from 1 to" in _refused(argv, capsys)


def test_num_replicas_zero_in_yaml_or_overrides_needs_autoscale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zero.yaml"
    path.write_text("pipeline: synthetic\nstages:\n  - stage_id: 1\n    num_replicas: 0\n")
    err = _refused(["--pipeline", "synthetic", "--deploy-config", str(path)], capsys)
    assert "stages[stage_id=1]: num_replicas is 0 but stage 1 has no autoscale policy" in err
    overrides = '{"1": {"num_replicas": 0}}'
    err = _refused(["--pipeline", "synthetic", "--stage-overrides", overrides], capsys)
    assert "num_replicas is 0 but stage 1 has no autoscale policy" in err


def test_replicas_count_in_the_devices_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage's devices cover the replicas --replicas asks for, not the YAML's count."""
    path = tmp_path / "gpus.yaml"
    path.write_text('pipeline: synthetic\nstages:\n  - {stage_id: 1, devices: "4,7"}\n')
    argv = ["--pipeline", "synthetic", "--deploy-config", str(path), "--replicas", "1:2:1"]
    config = cli_up.parse_args(argv, {})
    assert config.replicas == (1, 2, 1)
    argv[-1] = "1:3:1"
    assert "lists 2 device(s) ('4,7') but needs 3" in _refused(argv, capsys)
