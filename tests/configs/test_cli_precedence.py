"""Each CLI resolves its settings in one order: defaults < environment < flags (and, for the
deploy settings, YAML layers below the environment, --stage-overrides above the flags)."""

from __future__ import annotations

import pytest

from omni_mesh.configs.cli_flags import env_overrides
from omni_mesh.control_plane import cli as cp_cli
from omni_mesh.launcher import cli as up_cli
from omni_mesh.sidecar import cli_stage

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_omni_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("OMNI_"):
            monkeypatch.delenv(name)


def stage(argv: list[str]) -> cli_stage.StageSettings:
    return cli_stage.settings_from_args(cli_stage.parser().parse_args(argv))


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("OMNI_STAGE_PORT", "9121", "port", 9121),
        ("OMNI_STAGE_STAGE_ID", "2", "stage_id", 2),
        ("OMNI_STAGE_HEADLESS", "true", "headless", True),
        ("OMNI_STAGE_HOST", "0.0.0.0", "host", "0.0.0.0"),
        ("OMNI_STAGE_LOG_LEVEL", "debug", "log_level", "DEBUG"),
        ("OMNI_STAGE_CONTROL_PLANE", "http://a:1,http://b:2", "control_plane",
         ("http://a:1", "http://b:2")),
        ("OMNI_STAGE_DRAIN_TIMEOUT_S", "5", "drain_timeout_s", 5.0),
    ],
)  # fmt: skip
def test_omni_stage_variables_beat_defaults(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str, expected: object
) -> None:
    assert getattr(stage(["--pipeline", "synthetic"]), field) != expected
    monkeypatch.setenv(variable, value)
    assert getattr(stage(["--pipeline", "synthetic"]), field) == expected


def test_omni_stage_flags_beat_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STAGE_PORT", "9121")
    monkeypatch.setenv("OMNI_STAGE_HEADLESS", "1")
    monkeypatch.setenv("OMNI_STAGE_PIPELINE", "tiny-tts")
    s = stage(["--pipeline", "synthetic", "--port", "9200", "--no-headless"])
    assert (s.port, s.headless, s.pipeline) == (9200, False, "synthetic")
    assert stage([]).pipeline == "tiny-tts"  # --pipeline itself may come from the environment


def test_omni_stage_deploy_variables_sit_between_yaml_and_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNI_STAGE_MAX_INFLIGHT", "33")
    monkeypatch.setenv("OMNI_STAGE_ASYNC_CHUNK", "true")
    args = cli_stage.parser().parse_args(["--pipeline", "synthetic", "--stage-id", "1"])
    _, _, deploy, _ = cli_stage.resolve(args)
    assert (deploy.stage(1).max_inflight, deploy.async_chunk) == (33, True)
    args = cli_stage.parser().parse_args(
        ["--pipeline", "synthetic", "--stage-id", "1", "--max-inflight", "40", "--no-async-chunk"]
    )
    _, _, deploy, _ = cli_stage.resolve(args)
    assert (deploy.stage(1).max_inflight, deploy.async_chunk) == (40, False)
    with pytest.raises(ValueError, match=r"OMNI_STAGE_MAX_NUM_SEQS: .*got 'x'"):
        env_overrides({"OMNI_STAGE_MAX_NUM_SEQS": "x"})


def test_seed_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    s = stage(["--pipeline", "synthetic", "-oma", "cp.local", "-omp", "7800", "-ora", "10.0.0.5"])
    assert s.control_plane == ("http://cp.local:7800",)
    assert s.address == "http://10.0.0.5:8000"
    s = stage(["--pipeline", "synthetic", "--omni-replica-address", "http://pod-1:9000/"])
    assert s.address == "http://pod-1:9000"
    s = stage(["--pipeline", "synthetic", "-oma", "::1"])
    assert s.control_plane == ("http://[::1]:7700",)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--headless", "--api-only"], "--headless and --api-only exclude each other"),
        (["-oma", "bad host"], "--omni-master-address / OMNI_STAGE_OMNI_MASTER_ADDRESS: "
         "'bad host' is not a hostname or IP address"),
        (["--control-plane", "http://bad host:7700"], "is not a hostname or IP address"),
        (["-ora", "a b"], "--advertise-address / OMNI_STAGE_ADVERTISE_ADDRESS: 'a b' is not"),
        (["-omp", "7700"], "--omni-master-port needs --omni-master-address"),
        (["--port", "0"], "--port / OMNI_STAGE_PORT: Input should be greater than or equal to 1"),
    ],
)  # fmt: skip
def test_omni_stage_bad_input_is_one_line_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_stage.main(["--pipeline", "synthetic", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("omni-stage: error: ") and expected in err, err


def test_omni_cp_variables_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    parser, _ = cp_cli.build_parser()
    monkeypatch.setenv("OMNI_CP_PORT", "7801")
    monkeypatch.setenv("OMNI_CP_LEASE_TTL_MS", "5000")
    args = vars(parser.parse_args(["serve", "--port", "7900"]))
    args.pop("command")
    args.pop("pipeline_module", None)
    settings = cp_cli.ControlPlaneSettings(**args)
    assert (settings.port, settings.lease_ttl_ms, settings.sweep_interval_ms) == (7900, 5000, 250)


def test_omni_up_precedence() -> None:
    base = ["--pipeline", "tiny-omni"]
    assert up_cli.parse_args(base, {}).replicas == (1, 1, 1)  # the bundled YAML
    env = {"OMNI_UP_REPLICAS": "1:1:2", "OMNI_UP_PORT": "8100", "OMNI_STAGE_NUM_REPLICAS": "3"}
    assert up_cli.parse_args(base, {"OMNI_STAGE_NUM_REPLICAS": "3"}).replicas == (3, 3, 3)
    config = up_cli.parse_args(base, env)
    assert (config.replicas, config.port) == ((1, 1, 2), 8100)  # OMNI_UP_REPLICAS is --replicas
    config = up_cli.parse_args([*base, "--replicas", "2:1:1", "--port", "8200"], env)
    assert (config.replicas, config.port) == ((2, 1, 1), 8200)
    over = [*base, "--replicas", "2:1:1", "--stage-overrides", '{"1": {"num_replicas": 3}}']
    assert up_cli.parse_args(over, env).replicas == (2, 3, 1)  # --stage-overrides wins
    config = up_cli.parse_args([*base, "--async-chunk"], {})
    assert "--async-chunk" in config.stage_flags


def test_omni_up_bad_variable_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        up_cli.parse_args(["--pipeline", "tiny-tts"], {"OMNI_UP_PORT": "http"})
    assert exc.value.code == 2
    assert "--port / OMNI_UP_PORT: Input should be a valid integer" in capsys.readouterr().err
