"""Bad input to omni-stage is one line and exit 2 (a host that is not a hostname or IP, flags
that exclude each other, a misspelt deploy key); a valid but unreachable control plane is
retried, with a warning every few seconds, until it answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import (
    LOCALHOST,
    ManagedProcess,
    clean_env,
    free_port,
    start_control_plane,
    wait_until,
)
from tests.sidecar.topology import SECRET, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STAGE = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "synthetic"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--omni-master-address", "bad host"], "'bad host' is not a hostname or IP address"),
        (["--headless", "--api-only"], "--headless and --api-only exclude each other"),
        (["--stage-overrides", '{"0": {"max_num_seqz": 4}}'],
         "max_num_seqz: unknown key (did you mean 'max_num_seqs'?)"),
    ],
)  # fmt: skip
def test_one_line_and_exit_2(flags: list[str], expected: str, tmp_path: Path) -> None:
    deploy = tmp_path / "typo.yaml"
    deploy.write_text("stages:\n  - stage_id: 1\n    max_num_seqz: 4\n")
    for argv in ([*STAGE, *flags], [*STAGE, "--deploy-config", str(deploy)]):
        done = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("omni-stage: error: ") and done.stderr.count("\n") == 1
    assert (
        expected
        in subprocess.run(
            [*STAGE, *flags], env=clean_env(), capture_output=True, text=True, timeout=60
        ).stderr
    )


def test_unreachable_control_plane_is_retried_and_logged(tmp_path: Path) -> None:
    before = shm_segments()
    cp_port, port = free_port(), free_port()
    argv = [*STAGE, "--stage-id", "1", "--headless", "--port", str(port), "--secret", SECRET,
            "-oma", LOCALHOST, "-omp", str(cp_port)]  # fmt: skip
    pod = ManagedProcess(argv, name="pod", env=clean_env(), log_dir=tmp_path).start()
    cp = None
    try:
        pod.wait_for_output(r"control plane still unreachable after \d+s", 30, stream="stderr")
        assert pod.alive
        cp = start_control_plane(None, port=cp_port, log_dir=tmp_path, name="cp-late")
        pod.wait_http_ready(f"http://{LOCALHOST}:{port}/health", timeout=30)  # registered
        wait_until(lambda: "control plane reachable again" in pod.stderr, 10)
    finally:
        pod.cleanup()
        if cp is not None:
            cp.proc.terminate(timeout=10)
    assert shm_segments() - before == set()
