"""``promtool`` accepts the Prometheus configuration and the alert rules, and the rules' unit
tests (``alerts_test.yml``: which alerts fire for which series) pass.

``promtool`` comes with Debian's ``prometheus`` package, which ``make test`` installs when it
runs as root; without it these tests skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.observability.catalog import (
    ALERTS_TEST_YML,
    ALERTS_YML,
    COMPOSE,
    PROMETHEUS_YML,
    alert_rules,
    load_yaml,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; `make test` installs it)")
    return path


def _run(argv: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(argv)} failed ({proc.returncode}):\n{out}"
    return out


def test_check_config(promtool: str) -> None:
    out = _run([promtool, "check", "config", str(PROMETHEUS_YML)])
    assert f"{len(alert_rules())} rules found" in out, out


def test_check_config_with_each_topologys_targets(promtool: str, tmp_path: Path) -> None:
    """The file_sd target lists of the compose topologies are valid target groups."""
    targets = sorted((COMPOSE / "prometheus-targets").glob("*.yml"))
    assert len(targets) == 3
    for path in targets:
        config = load_yaml(PROMETHEUS_YML)
        config["rule_files"] = [str(ALERTS_YML)]
        for job in config["scrape_configs"]:
            for sd in job.get("file_sd_configs", []):
                sd["files"] = [str(path)]
        cfg = tmp_path / f"prometheus-{path.stem}.yml"
        cfg.write_text(yaml.safe_dump(config))
        out = _run([promtool, "check", "config", str(cfg)])
        assert "WARNING" not in out, out


def test_check_rules(promtool: str) -> None:
    out = _run([promtool, "check", "rules", str(ALERTS_YML)])
    assert f"SUCCESS: {len(alert_rules())} rules found" in out, out


def test_rules_unit_tests(promtool: str) -> None:
    _run([promtool, "test", "rules", ALERTS_TEST_YML.name], cwd=ALERTS_TEST_YML.parent)


def test_every_alert_has_a_unit_test() -> None:
    text = ALERTS_TEST_YML.read_text()
    untested = [r["alert"] for r in alert_rules() if f'alertname="{r["alert"]}"' not in text]
    assert not untested, f"alerts_test.yml never expects {untested} to fire"
