"""The pure helpers of the realtime benchmark: the console exporter's timestamps, the speech
onset, the cancel acknowledgements read from the stages' exported spans, memory per session.
No server started."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import numpy as np
import pytest

from benchmarks.realtime_phases import Idle, Talking, _iso_ns, _onset, stage_acks
from tests.sidecar.topology import Topology

pytestmark = pytest.mark.unit


def test_iso_timestamps_are_epoch_nanoseconds() -> None:
    ns = _iso_ns("2026-12-03T11:41:27.534297Z")
    expected = datetime(2026, 12, 3, 11, 41, 27, 534297, tzinfo=UTC).timestamp()
    assert ns == pytest.approx(expected * 1e9, abs=1e3)


def test_the_onset_is_the_first_loud_sample() -> None:
    audio = np.zeros(1000, np.int16)
    audio[10] = 300  # quiet: not speech
    audio[400] = -2000
    assert _onset(audio) == 400
    assert _onset(np.zeros(10, np.int16)) == 0


@dataclass
class _Proc:
    stderr: str


def _span(request_id: str, events: list[tuple[str, str]]) -> str:
    return json.dumps(
        {
            "name": "stage 1 talker",
            "attributes": {"omni.request_id": request_id},
            "events": [{"name": n, "timestamp": t, "attributes": {}} for n, t in events],
        }
    )


def test_stage_acks_take_the_latest_acknowledgement_of_the_request_per_stage() -> None:
    ack = "omni.cancel.acknowledged"
    lines = [
        "a log line, not a span",
        _span("resp_a", [("omni.cancel", "2026-12-03T10:00:00.000000Z"),
                         (ack, "2026-12-03T10:00:00.010000Z")]),
        _span("resp_a", [(ack, "2026-12-03T10:00:00.030000Z")]),  # a replayed attempt
        _span("resp_b", [(ack, "2026-12-03T10:00:05.000000Z")]),  # another response
    ]  # fmt: skip
    topo = cast(Topology, type("T", (), {"stages": {1: [_Proc("\n".join(lines))], 0: []}})())
    acks = stage_acks(topo, "resp_a")
    assert list(acks) == [1]
    assert acks[1] == _iso_ns("2026-12-03T10:00:00.030000Z")
    assert stage_acks(topo, "resp_c") == {}


def test_memory_per_session() -> None:
    assert Idle(100, rss_before_kib=1000, rss_after_kib=3000).per_session_kib == 20.0
    talking: Any = Talking(10, rss_before_kib=1000, rss_peak_kib=1500)
    assert talking.per_session_kib == 50.0
