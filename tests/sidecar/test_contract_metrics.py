"""Every stage execution is counted once in omni_stage_requests_total, the entry stage of a
non-headless pod included (route="api"), and work aborted by a deadline or a client that went
away is counted as outcome="cancelled" (real pods, synthetic pipeline, a slow middle stage).
API servers register with their role: omni-cp status lists them (ROLE column), discovery never
routes to an --api-only one."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import (
    LOCALHOST,
    ControlPlaneProcess,
    ManagedProcess,
    clean_env,
    free_port,
    start_control_plane,
    wait_until,
)
from tests.sidecar.topology import SECRET, http_get, post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SLOW = '{"1": {"step_latency_ms": 1500}}'


def counter(url: str, route: str, outcome: str) -> float:
    total = 0.0
    for line in http_get(url + "/metrics").decode().splitlines():
        head = line.split(" ", 1)[0]
        if head.startswith("omni_stage_requests_total{") and f'route="{route}"' in head:
            total += float(line.rsplit(" ", 1)[1]) if f'outcome="{outcome}"' in head else 0.0
    return total


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, str]]:
    before = shm_segments()
    tmp: Path = tmp_path_factory.mktemp("metrics")
    cp: ControlPlaneProcess = start_control_plane(None, log_dir=tmp, name="cp-metrics")
    procs: list[ManagedProcess] = []
    urls: dict[int, str] = {}
    try:
        for stage_id in (0, 1, 2, -1):  # -1: an --api-only server
            port = free_port()
            argv = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "synthetic",
                    "--stage-id", str(stage_id), "--control-plane", cp.url, "--port", str(port),
                    "--secret", SECRET, "--stage-overrides", SLOW]  # fmt: skip
            if stage_id > 0:
                argv.append("--headless")  # stage 0 serves the client API with its own engine
            elif stage_id < 0:
                argv[argv.index("--stage-id") + 1] = "0"
                argv.append("--api-only")
            procs.append(
                ManagedProcess(argv, name=f"s{stage_id}", env=clean_env(), log_dir=tmp).start()
            )
            urls[stage_id] = f"http://{LOCALHOST}:{port}"
        for proc, url in zip(procs, list(urls.values()), strict=True):
            proc.wait_http_ready(url + "/health", timeout=90)
        urls[-2] = cp.url
        yield urls
    finally:
        for proc in procs:
            proc.terminate(timeout=20)
        cp.proc.terminate(timeout=10)
    assert shm_segments() - before == set()


def test_each_stage_counts_its_execution_once(pods: dict[int, str]) -> None:
    status, body = post_json(pods[0] + "/v1/generate", {"prompt": "x", "seed": 1})
    assert status == 200, body
    assert counter(pods[0], "api", "ok") == 1  # its own engine's execution
    assert counter(pods[0], "hop", "ok") == 0
    assert counter(pods[1], "hop", "ok") == 1
    assert counter(pods[2], "hop", "ok") == 1


def test_deadline_and_disconnect_count_as_cancelled(pods: dict[int, str]) -> None:
    request = urllib.request.Request(
        pods[0] + "/v1/generate",
        data=json.dumps({"prompt": "late", "seed": 2}).encode(),
        headers={"Content-Type": "application/json", "X-Omni-Timeout-S": "0.5"},
    )
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(request, timeout=30)
    exc.value.close()
    assert exc.value.code == 504
    wait_until(lambda: counter(pods[0], "api", "cancelled") == 1, 10)
    # A client that goes away: the request is aborted on every stage still holding it.
    body = json.dumps({"prompt": "gone", "seed": 3}).encode()
    head = (
        f"POST /v1/generate HTTP/1.1\r\nHost: {LOCALHOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    port = int(pods[0].rsplit(":", 1)[1])
    busy = counter(pods[1], "hop", "cancelled")
    with socket.create_connection((LOCALHOST, port), timeout=5) as sock:
        sock.sendall(head + body)
        wait_until(lambda: "omni_stage_in_flight" in http_get(pods[1] + "/metrics").decode(), 5)
        time.sleep(0.3)  # stage 1 is in its 1.5 s step when the client leaves
    wait_until(lambda: counter(pods[0], "api", "cancelled") == 2, 15)
    wait_until(lambda: counter(pods[1], "hop", "cancelled") > busy, 15)
    assert counter(pods[0], "api", "ok") == 1  # nothing counted twice


def test_api_servers_are_listed_with_their_role_but_not_routed_to(pods: dict[int, str]) -> None:
    cp = pods[-2]
    argv = [sys.executable, "-m", "omni_mesh.control_plane", "status", "--cp", cp]
    done = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["PIPELINE", "STAGE", "ROLE"]
    roles = {row.split()[5]: row.split()[2] for row in lines[1:]}  # address -> role
    assert roles == {pods[0]: "api", pods[1]: "headless", pods[2]: "headless", pods[-1]: "api-only"}
    pool = json.loads(http_get(f"{cp}/v1/pipelines/synthetic/stages/0/instances"))
    assert [i["address"] for i in pool["instances"]] == [pods[0]]
    status, body = post_json(pods[-1] + "/v1/generate", {"prompt": "via api", "seed": 4})
    assert status == 200, body  # the API server routes into the stage-0 pool
