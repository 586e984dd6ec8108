"""The data path across real processes: shared-memory hand-offs carrying handles (and http ones
carrying bytes), a client that goes away aborting the request on every stage, and a kill -9 of
a sidecar leaving no shared memory behind. (Identical bytes under replay: the kill test of
test_topology_omni.py, which shares its tiny-omni 1:2:1.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import wait_until
from tests.sidecar.topology import Topology, engine_pid, post_json, shm_segments, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HTTP_EDGE = json.dumps(
    {
        "0": {"output_connectors": {"to_stage_1": "http"}},
        "1": {"input_connectors": {"from_stage_0": "http"}},
    }
)


@pytest.fixture
def no_shm_leak() -> Iterator[None]:
    before = shm_segments()
    yield
    wait_until(lambda: not (shm_segments() - before), 5.0, message=lambda: "shm leaked")


def _audio(topo: Topology, prompt: str, seed: int) -> bytes:
    status, body = post_json(
        topo.api_url + "/v1/generate", {"prompt": prompt, "seed": seed, "voice": "onyx"}
    )
    assert status == 200, body
    return bytes(json.loads(body)["outputs"]["2"]["data"], "ascii")


@pytest.mark.parametrize("overrides", [None, HTTP_EDGE], ids=["shm", "http"])
def test_connector_decides_what_a_hop_carries(
    tmp_path: Path, no_shm_leak: None, overrides: str | None
) -> None:
    extra = ["--stage-overrides", overrides] if overrides else []
    topo = Topology("tiny-omni", [1, 1, 1], tmp_path, extra_stage_args=extra).start()
    try:
        topo.wait_discovered(2, 1)
        long_prompt = "A paragraph long enough for megabytes of hidden states. " * 10
        for seed in range(3):
            _audio(topo, long_prompt, seed)
        sent = topo.metric(
            topo.urls[0][0], "omni_stage_handoff_bytes_total", from_stage="0", to_stage="1"
        )
        per_hop = sent / 3
        if overrides is None:
            assert per_hop < 64 * 1024, per_hop  # handles only: the hidden states stay in shm
        else:
            assert per_hop > 1024 * 1024, per_hop  # the hidden states themselves
    finally:
        topo.close()


def test_client_disconnect_aborts_every_stage(tmp_path: Path, no_shm_leak: None) -> None:
    slow = json.dumps({"2": {"step_latency_ms": 4000}})
    topo = Topology(
        "synthetic", [1, 1, 1], tmp_path, extra_stage_args=["--stage-overrides", slow]
    ).start()
    try:
        topo.wait_discovered(2, 1)
        last = topo.urls[2][0]

        def client() -> None:
            req = urllib.request.Request(
                topo.api_url + "/v1/generate",
                data=b'{"prompt": "bye"}',
                headers={"Content-Type": "application/json"},
            )
            # The client gives up after 0.8 s: that is the point of the test.
            with contextlib.suppress(TimeoutError, urllib.error.URLError):
                urllib.request.urlopen(req, timeout=0.8).read()

        t = threading.Thread(target=client)
        t.start()
        wait_until(lambda: topo.metric(last, "omni_stage_in_flight") == 1, 5.0)
        t.join()
        t0 = time.monotonic()
        wait_until(lambda: topo.metric(last, "omni_stage_in_flight") == 0, 3.0)
        assert time.monotonic() - t0 < 3.0  # well before the 4 s step would have ended
    finally:
        topo.close()


def test_kill_9_of_a_sidecar_frees_its_engine_and_shm(tmp_path: Path, no_shm_leak: None) -> None:
    topo = Topology("tiny-tts", [1, 1], tmp_path, api=False).start()
    try:
        pod = topo.stages[1][0]
        engine = engine_pid(pod)
        status, _ = post_json(
            topo.urls[0][0] + "/v1/run", {"stage_id": 0, "stage_input": {"prompt": "x"}}
        )
        assert status == 200
        os.kill(pod.pid, signal.SIGKILL)
        wait_gone(engine, 5.0)
        topo.wait_discovered(1, 0, timeout=6.0)
    finally:
        topo.close()
