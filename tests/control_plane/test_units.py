"""Unit tests: settings, input parsing, status rendering, backoff."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omni_mesh.configs.settings import ControlPlaneClientSettings, ControlPlaneSettings, LogLevel
from omni_mesh.control_plane.api.inputs import describe_validation_error
from omni_mesh.control_plane.client import Backoff
from omni_mesh.control_plane.schema import (
    InstanceInfo,
    InstanceState,
    LoadReport,
    PipelineList,
    PipelineSnapshot,
    PipelineStatus,
    RegisterRequest,
)
from omni_mesh.control_plane.status import COLUMNS, format_age, render_status

pytestmark = pytest.mark.unit


def test_settings_defaults() -> None:
    s = ControlPlaneSettings()
    assert (s.host, s.port, s.redis_url, s.auth_token) == ("127.0.0.1", 7700, None, None)
    assert (s.heartbeat_interval_ms, s.lease_ttl_ms, s.sweep_interval_ms) == (1000, 3000, 250)
    assert s.evict_after_ms == 60_000
    assert s.log_level is LogLevel.INFO
    for name, field in ControlPlaneSettings.model_fields.items():
        assert field.description, f"{name} has no description"


def test_settings_from_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_CP_LEASE_TTL_MS", "5000")
    monkeypatch.setenv("OMNI_CP_PORT", "7800")
    monkeypatch.setenv("OMNI_CP_AUTH_TOKEN", "s3cret")
    monkeypatch.setenv("OMNI_CP_LOG_LEVEL", "debug")
    s = ControlPlaneSettings(port=7900)
    assert (s.lease_ttl_ms, s.port, s.token, s.log_level) == (5000, 7900, "s3cret", LogLevel.DEBUG)
    assert "s3cret" not in repr(s)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"redis_url": "http://x"}, "redis_url"),
        ({"lease_ttl_ms": 900, "heartbeat_interval_ms": 1000}, ""),
        ({"sweep_interval_ms": 5}, "sweep_interval_ms"),
        ({"auth_token": "  "}, "auth_token"),
        ({"log_level": "loud"}, "log_level"),
    ],
)
def test_settings_bounds(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ControlPlaneSettings(**kwargs)  # type: ignore[arg-type]
    assert ".".join(map(str, info.value.errors()[0]["loc"])) == field


def test_client_settings_split_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_CP_URL", "http://a:1, http://b:2")
    assert ControlPlaneClientSettings().urls == ("http://a:1", "http://b:2")


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (b"{", "body", "not valid JSON"),
        (b"[1]", "body", "JSON object"),
        (b'{"pipeline": "p", "stage_id": 0, "capacity": 1}', "address", "required"),
        (b'{"pipeline":"p","stage_id":0,"capacity":1,"address":"ftp://h:1"}', "address", "http"),
        (
            b'{"pipeline":"p","stage_id":0,"capacity":1,"address":"http://h:1","x":1}',
            "x",
            "unknown",
        ),
    ],
)
def test_validation_errors_name_the_field(body: bytes, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        RegisterRequest.model_validate_json(body)
    message, named = describe_validation_error(info.value)
    assert named == field
    assert words in message
    if field != "body":
        assert message.startswith(field)


def _info(**kw: object) -> InstanceInfo:
    base: dict[str, object] = {
        "instance_id": "abc",
        "pipeline": "tiny-omni",
        "stage_id": 1,
        "address": "http://127.0.0.1:9001",
        "host_id": "h1",
        "capacity": 4,
        "state": InstanceState.HEALTHY,
        "epoch": 1,
        "registered_at_ms": 1,
        "last_heartbeat_ms": 1,
        "heartbeat_age_ms": 1500,
        "load": LoadReport(in_flight=2, capacity=4),
    }
    base.update(kw)
    return InstanceInfo.model_validate(base)


def test_status_table() -> None:
    listing = PipelineList(
        pipelines=(
            PipelineStatus(
                pipeline="tiny-omni",
                version=3,
                instances=(
                    _info(),
                    _info(
                        instance_id="def",
                        stage_id=0,
                        state=InstanceState.ISOLATED,
                        reason="lease_expired",
                        heartbeat_age_ms=125_000,
                    ),
                ),
                api_servers=(_info(instance_id="api1", stage_id=0, labels={"role": "api-only"}),),
            ),
        )
    )
    lines = render_status(listing).splitlines()
    assert lines[0].split() == list(COLUMNS)
    assert lines[1].split()[:3] == ["tiny-omni", "0", "api-only"]  # registered first
    assert lines[2].split() == [
        "tiny-omni", "0", "-", "def", "isolated", "http://127.0.0.1:9001", "h1", "2/4", "2m05s",
        "lease_expired", "-",
    ]  # fmt: skip
    assert lines[3].split()[:9] == [
        "tiny-omni", "1", "-", "abc", "healthy", "http://127.0.0.1:9001", "h1", "2/4", "1.5s",
    ]  # fmt: skip
    assert (
        render_status(listing, pipeline="tiny-tts")
        == "no instances registered for pipeline 'tiny-tts'"
    )
    assert render_status(PipelineList()) == "no instances registered"


def test_format_age() -> None:
    assert [format_age(ms) for ms in (0, 9_999, 59_000, 3_600_000, 8_000_000)] == [
        "0.0s", "10.0s", "59s", "60m00s", "2h13m",
    ]  # fmt: skip


def test_backoff_is_capped_and_resets() -> None:
    b = Backoff(0.1, 0.4, jitter=0.0)
    assert [b.next() for _ in range(4)] == pytest.approx([0.1, 0.2, 0.4, 0.4])
    b.reset()
    assert b.next() == pytest.approx(0.1)


def test_snapshot_helpers() -> None:
    snap = PipelineSnapshot.model_validate_json(
        '{"pipeline": "p", "version": 3, "stages": {"0": []}}'
    )
    assert snap.version == 3
    assert snap.healthy(0) == () and snap.healthy(5) == ()
