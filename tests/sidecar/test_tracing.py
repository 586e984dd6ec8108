"""One trace per request across processes: the API server and every stage export spans that
share the client's trace id, each stage's span a child of the one before."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.procs import wait_until
from tests.sidecar.topology import Topology

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _spans(text: str) -> list[dict[str, object]]:
    spans = []
    for line in text.splitlines():
        if line.startswith('{"name"'):
            spans.append(json.loads(line))
    return spans


def test_a_request_is_one_trace_across_stages(tmp_path: Path) -> None:
    topo = Topology("tiny-tts", [1, 1], tmp_path, extra_stage_args=["--tracing", "console"])
    topo.start()
    try:
        topo.wait_discovered(1, 1)
        request = urllib.request.Request(
            topo.api_url + "/v1/generate",
            data=b'{"prompt": "trace me", "seed": 2}',
            headers={"Content-Type": "application/json", "traceparent": TRACEPARENT},
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
        procs = [topo.api, topo.stages[0][0], topo.stages[1][0]]

        def exported() -> bool:
            return all(p is not None and _spans(p.stderr) for p in procs)

        wait_until(exported, 10.0, message=lambda: "spans not exported")
        api, talker, code2wav = (_spans(p.stderr)[-1] for p in procs if p is not None)
        ids = [s["context"]["trace_id"] for s in (api, talker, code2wav)]  # type: ignore[index]
        assert ids == [f"0x{TRACE_ID}"] * 3
        assert talker["parent_id"] == api["context"]["span_id"]  # type: ignore[index]
        assert code2wav["parent_id"] == talker["context"]["span_id"]  # type: ignore[index]
        assert talker["name"] == "stage 0 talker"
        assert talker["attributes"]["omni.stage_id"] == 0  # type: ignore[index]
    finally:
        topo.close()
