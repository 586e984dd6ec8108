"""A stage pod's life at its edges: started before its control plane (it listens, says it is
registering, registers when the control plane appears, and stops at once on SIGTERM whatever
it is waiting for), bad flags (exit 2), hops without the deployment's token (401), and a hop
replayed when the replica holding it dies mid-request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import codec
from omni_mesh.data_plane.messages import Payload, StageInput
from tests.procs import (
    LOCALHOST,
    ManagedProcess,
    clean_env,
    free_port,
    start_control_plane,
    wait_until,
)
from tests.sidecar.topology import SECRET, Topology, post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _status(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}  # not listening yet


def _stage(port: int, cp_url: str, tmp_path: Path, *extra: str) -> ManagedProcess:
    return ManagedProcess(
        [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "tiny-tts",
         "--stage-id", "1", "--headless", "--control-plane", cp_url, "--host", LOCALHOST,
         "--port", str(port), "--secret", SECRET, *extra],
        name=f"stage-{port}", env=clean_env(), log_dir=tmp_path,
    ).start()  # fmt: skip


def test_started_before_its_control_plane(tmp_path: Path) -> None:
    before = shm_segments()
    cp_port, port = free_port(), free_port()
    cp_url = f"http://{LOCALHOST}:{cp_port}"
    pod = _stage(port, cp_url, tmp_path)
    try:
        health = f"http://{LOCALHOST}:{port}/health"
        wait_until(lambda: _status(health)[0] == 503, 60, message=pod.describe)
        assert _status(health)[1]["status"] == "registering"
        cp = start_control_plane(None, port=cp_port, log_dir=tmp_path)
        try:
            pod.wait_http_ready(health, timeout=30)
            assert _status(health)[1]["instance_id"]
        finally:
            cp.proc.terminate()
        # The control plane is gone again: SIGTERM still stops the pod cleanly.
        assert pod.terminate(timeout=20) == 0
    finally:
        pod.cleanup()
    assert shm_segments() - before == set()


def test_sigterm_while_waiting_for_the_control_plane(tmp_path: Path) -> None:
    port = free_port()
    pod = _stage(port, f"http://{LOCALHOST}:{free_port()}", tmp_path)
    try:
        wait_until(lambda: _status(f"http://{LOCALHOST}:{port}/health")[0] == 503, 60)
        t0 = time.monotonic()
        assert pod.terminate(timeout=15) == 0
        assert time.monotonic() - t0 < 10
    finally:
        pod.cleanup()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--control-plane", "ftp://x:1"], "--control-plane"),
        (["--control-plane", "http://host-without-port"], "--control-plane"),
        (["--omni-master-port", "7700"], "--omni-master-address"),
        (["--stage-overrides", '{"1": {"async_chunk": true}}'], "async_chunk"),
        (["--max-num-seqs", "0"], "max-num-seqs"),
    ],
)
def test_bad_flags_exit_2(flags: list[str], needle: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "tiny-tts",
         "--stage-id", "1", "--headless", *flags],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr


def test_bad_engine_settings_exit_2_with_one_line() -> None:
    """engine_extras are checked by the engine as it loads; a bad one is still a bad setting:
    exit 2 naming it, no traceback (a supervisor restarting the pod could not help)."""
    result = subprocess.run(
        [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "tiny-tts",
         "--stage-id", "0", "--headless", "--port", str(free_port()),
         "--stage-overrides", '{"0": {"engine_extras": {"chunk_frames": 0}}}'],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "engine_extras.chunk_frames must be an integer in [1, 1024], got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_connector_extra_exits_2_with_one_line(tmp_path: Path) -> None:
    """Connectors are built once per edge at start: a bad ``extra`` stops ``omni-stage`` with
    exit 2 naming the edge and the option, before it serves a hop (not a 500 at the first)."""
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        "connectors:\n  http: {name: HttpConnector, extra: {timeout_s: 30}}\n"
        "stages:\n  - stage_id: 0\n    output_connectors: {to_stage_1: http}\n"
        "  - stage_id: 1\n    input_connectors: {from_stage_0: http}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "tiny-tts",
         "--stage-id", "0", "--headless", "--port", str(free_port()),
         "--deploy-config", str(deploy)],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "omni-stage: error: connectors: edge 0->1: HttpConnector: unknown option 'timeout_s' "
        "in extra (this connector takes no options)"
    ]


def test_a_hop_needs_the_deployment_token(tmp_path: Path) -> None:
    # Stage 1 alone: the forged hop claims to come from stage 0, which need not run.
    topo = Topology("tiny-tts", [1, 1], tmp_path, api=False).start(stages=[1])
    try:
        forged = StageInput(
            pipeline="tiny-tts", request_id="forged", stage_id=1, from_stage=0,
            deadline_ms=int(time.time() * 1000) + 60_000, seed=1, payload=Payload(),
        )  # fmt: skip
        assert get_pipeline("tiny-tts").has_edge(0, 1)
        for headers in ({}, {"X-Omni-Hop-Token": "0" * 64}):
            req = urllib.request.Request(
                topo.urls[1][0] + "/v1/hop",
                data=codec.encode(forged),
                headers={"Content-Type": "application/msgpack", **headers},
            )
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            assert err.value.code == 401
            assert "X-Omni-Hop-Token" in err.value.read().decode()
    finally:
        topo.close()


def test_a_hop_in_flight_on_a_dying_replica_is_replayed(tmp_path: Path) -> None:
    slow = json.dumps({"1": {"step_latency_ms": 1500}})
    topo = Topology(
        "synthetic", [1, 2, 1], tmp_path, extra_stage_args=["--stage-overrides", slow]
    ).start()
    try:
        topo.wait_discovered(1, 2)
        result: dict[str, object] = {}

        def client() -> None:
            result["answer"] = post_json(topo.api_url + "/v1/generate", {"prompt": "p", "seed": 4})

        t = threading.Thread(target=client)
        t.start()
        holding = None

        def someone_holds_it() -> bool:
            nonlocal holding
            for proc, url in zip(topo.stages[1], topo.urls[1], strict=True):
                if topo.metric(url, "omni_stage_in_flight") == 1:
                    holding = proc
                    return True
            return False

        wait_until(someone_holds_it, 10)
        assert holding is not None
        os.kill(holding.pid, signal.SIGKILL)  # the sidecar: the hop's connection resets
        t.join(timeout=60)
        status, _ = result["answer"]  # type: ignore[misc]
        assert status == 200
        retries = topo.metric(topo.urls[0][0], "omni_stage_hop_retries_total", to_stage="1")
        assert retries == 1
    finally:
        topo.close()
