"""omni-up's children inherit its environment except the variables of the settings omni-up
gives each child itself (role, address, control plane, configuration): those stay with omni-up,
so explicit per-child settings win. (A real omni-up started with such variables set is in
``test_autoscale_actuator.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_mesh.launcher.local_deploy import (
    CHILD_CP_SETTINGS,
    CHILD_STAGE_SETTINGS,
    SECRET_ENV,
    child_environment,
)

pytestmark = pytest.mark.unit

PER_CHILD = {
    "OMNI_STAGE_HEADLESS": "1",
    "OMNI_STAGE_API_ONLY": "1",
    "OMNI_STAGE_STAGE_ID": "2",
    "OMNI_STAGE_PORT": "1",
    "OMNI_STAGE_HOST": "0.0.0.0",
    "OMNI_STAGE_ADVERTISE_ADDRESS": "http://10.9.9.9:1",
    "OMNI_STAGE_OMNI_MASTER_ADDRESS": "10.9.9.9",
    "OMNI_STAGE_CONTROL_PLANE": "http://10.9.9.9:7700",
    "OMNI_STAGE_PIPELINE": "tiny-omni",
    "OMNI_STAGE_DEPLOY_CONFIG": "/nowhere.yaml",
    "OMNI_STAGE_DRAIN_TIMEOUT_S": "1",
    "OMNI_CP_PORT": "1",
    "OMNI_CP_HOST": "0.0.0.0",
}
KEPT = {
    "PATH": "/usr/bin",
    "OMNI_STAGE_MAX_NUM_SEQS": "4",  # a deploy knob: every child reads it, as omni-up did
    "OMNI_STAGE_TRACING": "console",
    "OMNI_CP_HEARTBEAT_INTERVAL_MS": "500",
}


def test_per_child_settings_are_not_inherited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="omni_mesh.launcher.local_deploy")
    env = child_environment({**PER_CHILD, **KEPT, SECRET_ENV: "from-the-shell"}, "s" * 32)
    assert env == {**KEPT, SECRET_ENV: "s" * 32, "PYTHONUNBUFFERED": "1"}
    assert "OMNI_STAGE_HEADLESS" in caplog.text and "OMNI_CP_PORT" in caplog.text


def test_nothing_to_drop_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="omni_mesh.launcher.local_deploy")
    assert child_environment(KEPT, "s" * 32)[SECRET_ENV] == "s" * 32
    assert caplog.text == ""


def test_the_configuration_doc_lists_every_variable_not_passed_on() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    section = doc[doc.index("### `omni-up`") :]
    for field in CHILD_STAGE_SETTINGS:
        if field != "secret":  # OMNI_SECRET: replaced by omni-up's, said separately
            assert f"`{field.upper()}`" in section, field
    for field in CHILD_CP_SETTINGS:
        assert f"`OMNI_CP_{field.upper()}`" in section, field
