"""Pods of one pipeline that disagree on a pipeline-wide setting: the second is refused by the
control plane (409 naming async_chunk) and omni-stage exits 2 saying so; once the first pod has
left, the other setting is accepted. A pod whose lease lapsed while a pipeline with the other
setting registered is refused by its next heartbeat (409) and exits 2 the same way."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from tests.procs import LOCALHOST, ManagedProcess, clean_env, free_port, start_control_plane
from tests.sidecar.topology import SECRET, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def pod(cp_url: str, stage_id: int, tmp: Path, *flags: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "synthetic",
            "--stage-id", str(stage_id), "--headless", "--control-plane", cp_url,
            "--port", str(port), "--secret", SECRET, *flags]  # fmt: skip
    name = f"s{stage_id}-{port}"
    return ManagedProcess(argv, name=name, env=clean_env(), log_dir=tmp).start(), (
        f"http://{LOCALHOST}:{port}"
    )


def test_async_chunk_must_agree_across_a_pipelines_pods(tmp_path: Path) -> None:
    before = shm_segments()
    cp = start_control_plane(None, log_dir=tmp_path, name="cp-fingerprint")
    procs: list[ManagedProcess] = []
    try:
        first, url = pod(cp.url, 1, tmp_path)
        procs.append(first)
        first.wait_http_ready(url + "/health", timeout=90)
        refused, _ = pod(cp.url, 2, tmp_path, "--async-chunk")
        procs.append(refused)
        assert refused.wait(60) == 2, refused.describe()
        assert "registration refused" in refused.stderr and "409" in refused.stderr
        assert "pipeline-wide setting async_chunk is true on this pod but false" in refused.stderr
        assert first.terminate(timeout=20) == 0  # leaves the pool: the fingerprint is released
        accepted, url = pod(cp.url, 2, tmp_path, "--async-chunk")
        procs.append(accepted)
        accepted.wait_http_ready(url + "/health", timeout=90)
    finally:
        for proc in procs:
            proc.cleanup()
        cp.proc.terminate(timeout=10)
    assert shm_segments() - before == set()


def test_a_pod_back_from_a_lapsed_lease_is_checked_again(tmp_path: Path) -> None:
    before = shm_segments()
    cp = start_control_plane(
        None, log_dir=tmp_path, name="cp-readmit", heartbeat_interval_ms=200, lease_ttl_ms=600
    )
    procs: list[ManagedProcess] = []
    try:
        away, url = pod(cp.url, 1, tmp_path)
        procs.append(away)
        away.wait_http_ready(url + "/health", timeout=90)
        away.send_signal(signal.SIGSTOP)  # no heartbeats: its lease lapses
        time.sleep(1.0)
        other, url = pod(cp.url, 2, tmp_path, "--async-chunk")  # the fingerprint is replaced
        procs.append(other)
        other.wait_http_ready(url + "/health", timeout=90)
        away.send_signal(signal.SIGCONT)
        assert away.wait(60) == 2, away.describe()
        refused = [line for line in away.stderr.splitlines() if "refused" in line]
        assert len(refused) == 1 and "heartbeat refused" in refused[0], away.stderr
        assert "409" in refused[0], refused
        assert "pipeline-wide setting async_chunk is false on this pod but true" in refused[0]
        assert other.alive
        assert other.terminate(timeout=20) == 0
    finally:
        for proc in procs:
            if proc.alive:
                proc.send_signal(signal.SIGCONT)
            proc.cleanup()
        cp.proc.terminate(timeout=10)
    assert shm_segments() - before == set()
