"""Joins through real pods: synthetic-diamond (s0 -> (s1, s2) -> s3) with omni-cp, every stage
as an ``omni-stage`` process and an API server. s3 runs exactly once per request with both
sources' outputs, whichever branch is slower; a branch's error fails the request; the deadline
holds across the join; a kill -9 of the s3 replica running a request is replayed with the same
answer. ``/v1/run`` join calls are in test_joins_run.py."""

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
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import clean_env, wait_until
from tests.sidecar.joins import expected_s3, generate
from tests.sidecar.topology import Topology, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SLOW_S1 = {"1": {"step_latency_ms": 300}, "3": {"step_latency_ms": 400}}
SLOW_S2 = {"2": {"step_latency_ms": 300}}
SEEDS = (11, 12)


@pytest.fixture(scope="module")
def slow_s1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """s1 the slower branch, s3 slow enough to be killed mid-request, two s3 replicas."""
    before = shm_segments()
    extra = ["--stage-overrides", json.dumps(SLOW_S1)]
    log_dir = tmp_path_factory.mktemp("diamond-slow-s1")
    topo = Topology("synthetic-diamond", [1, 1, 1, 2], log_dir, extra_stage_args=extra)
    try:
        topo.start()
        topo.wait_discovered(3, 2)
        yield topo
    finally:
        topo.close()
    time.sleep(0.2)
    assert shm_segments() - before == set(), "shared-memory segments leaked"


def _s3_runs(topo: Topology) -> float:
    return sum(topo.metric(url, "omni_stage_requests_total", route="hop") for url in topo.urls[3])


def test_join_runs_once_with_both_sources(slow_s1: Topology) -> None:
    runs = _s3_runs(slow_s1)
    for seed in SEEDS:
        assert generate(slow_s1.api_url, seed) == expected_s3(seed)
    assert _s3_runs(slow_s1) - runs == len(SEEDS)  # once per request, not once per branch
    for stage in (1, 2):
        assert slow_s1.metric(slow_s1.urls[stage][0], "omni_stage_requests_total") >= len(SEEDS)


def test_answer_does_not_depend_on_which_branch_is_slower(
    slow_s1: Topology, tmp_path: Path
) -> None:
    extra = ["--stage-overrides", json.dumps(SLOW_S2)]
    topo = Topology("synthetic-diamond", [1, 1, 1, 1], tmp_path, extra_stage_args=extra)
    try:
        topo.start()
        topo.wait_discovered(3, 1)
        for seed in SEEDS:
            assert generate(topo.api_url, seed) == generate(slow_s1.api_url, seed)
        assert _s3_runs(topo) == len(SEEDS)
    finally:
        topo.close()


def test_a_failing_branch_fails_the_request_with_its_error(slow_s1: Topology) -> None:
    runs = _s3_runs(slow_s1)
    status, body = _post(slow_s1.api_url + "/v1/generate", {"prompt": "fail:s2", "seed": 1})
    assert status == 400, body
    error = json.loads(body)["error"]
    assert "synthetic failure requested at stage 2 (s2)" in error["message"]
    assert _s3_runs(slow_s1) == runs  # the join never ran


def test_deadline_across_the_join_is_a_504(slow_s1: Topology) -> None:
    # The deadline passes while the slow branch (s1, 300 ms) runs: that branch's deadline
    # error is the request's, and the join is never handed off.
    runs = _s3_runs(slow_s1)
    t0 = time.monotonic()
    status, body = _post(
        slow_s1.api_url + "/v1/generate", {"prompt": "late", "seed": 2}, timeout_s=0.15
    )
    assert status == 504, body
    assert "deadline passed" in json.loads(body)["error"]["message"]
    assert time.monotonic() - t0 < 5.0
    assert _s3_runs(slow_s1) == runs


@pytest.mark.parametrize("mode", [[], ["--msgpack"]], ids=["json", "msgpack"])
def test_omni_run_follows_the_join(slow_s1: Topology, tmp_path: Path, mode: list[str]) -> None:
    out = tmp_path / "s3.bin"
    argv = [
        sys.executable, "-m", "omni_mesh.run_client.cli",
        "--pipeline", "synthetic-diamond", "--url", slow_s1.api_url,
        "--prompt", "p", "--seed", str(SEEDS[0]), "-o", str(out), *mode,
    ]  # fmt: skip
    runs = _s3_runs(slow_s1)
    done = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == expected_s3(SEEDS[0]).data
    assert "4 calls" in done.stdout + done.stderr  # s0, s1, s2, then s3 once
    assert _s3_runs(slow_s1) == runs  # /v1/run calls are not hops


def test_kill_9_of_the_join_replica_is_replayed(slow_s1: Topology) -> None:
    reference = generate(slow_s1.api_url, 21)
    answer: list[object] = []
    thread = threading.Thread(target=lambda: answer.append(generate(slow_s1.api_url, 21)))
    thread.start()
    busy = -1

    def one_busy() -> bool:
        nonlocal busy
        for i, url in enumerate(slow_s1.urls[3]):
            if slow_s1.metric(url, "omni_stage_in_flight") >= 1:
                busy = i
                return True
        return False

    wait_until(one_busy, 10.0, interval=0.01, message="no s3 replica took the join")
    os.kill(slow_s1.stages[3][busy].pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert answer == [reference]
    # The collector (s0's runner) replayed the join on the other replica.
    collector = slow_s1.urls[0][0]
    assert slow_s1.metric(collector, "omni_stage_hop_retries_total", to_stage="3") >= 1


def test_async_chunk_with_a_join_is_refused_at_start(tmp_path: Path) -> None:
    config = tmp_path / "diamond-chunks.yaml"
    config.write_text("pipeline: synthetic-diamond\nasync_chunk: true\n")
    argv = [
        sys.executable, "-m", "omni_mesh.sidecar.cli_stage",
        "--pipeline", "synthetic-diamond", "--stage-id", "1", "--headless",
        "--control-plane", "http://127.0.0.1:9", "--deploy-config", str(config),
    ]  # fmt: skip
    done = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "pipeline 'synthetic-diamond' cannot stream chunks (async_chunk: true)" in lines[0]
    assert "stage 3 (s3) is a join of stages [1, 2]" in lines[0]


def _post(url: str, body: object, *, timeout_s: float | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if timeout_s is not None:
        headers["X-Omni-Timeout-S"] = str(timeout_s)
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
