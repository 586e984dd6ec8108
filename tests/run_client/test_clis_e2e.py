"""The CLIs against real processes: ``omni-up`` brings a topology up and takes it all down on
SIGTERM (on Ctrl-C: tests/launcher); ``omni-run`` loops /v1/run through an API server, through
stage URLs and through control-plane discovery, in JSON and msgpack, writing the same WAV each
time."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import media_readers
from tests.procs import ManagedProcess, clean_env, descendants, free_port, pid_alive
from tests.sidecar.topology import SECRET, Topology, post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_omni_up_serves_and_leaves_nothing_after_sigterm(tmp_path: Path) -> None:
    """Its Ctrl-C twin (same topology, same checks) is part of the Ctrl-C drain test in
    tests/launcher/test_omni_up_lifecycle.py, which starts the same processes."""
    before = shm_segments()
    port = free_port()
    up = ManagedProcess(
        [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", "tiny-tts",
         "--replicas", "1:2", "--port", str(port)],
        name="omni-up", env=clean_env(), log_dir=tmp_path,
    ).start()  # fmt: skip
    try:
        up.wait_for_output(r"omni-up ready: http://127\.0\.0\.1:\d+", timeout=120)
        assert re.search(r"control plane\s+http://", up.stdout)
        children = descendants(up.pid)
        assert len(children) >= 5  # omni-cp (+ redis), 3 pods (+ engines), API server
        status, body = post_json(
            f"http://127.0.0.1:{port}/v1/audio/speech",
            {"model": "tiny-tts", "input": "up", "voice": "echo"},
        )
        assert status == 200 and media_readers.read_wav(body)[1] == 24000
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        assert [p for p in children if pid_alive(p)] == []
        assert shm_segments() - before == set()
    finally:
        up.cleanup()


@pytest.fixture(scope="module")
def tts(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    topo = Topology("tiny-tts", [1, 1], tmp_path_factory.mktemp("tts")).start()
    yield topo  # type: ignore[misc]
    topo.close()


def _omni_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_mesh.run_client.cli", "--pipeline", "tiny-tts",
         "--prompt", "The same words.", "--seed", "99", "--voice", "nova", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip


def test_omni_run_three_ways_same_wav(tts: Topology, tmp_path: Path) -> None:
    assert tts.cp is not None
    ways = {
        "api": ["--url", tts.api_url],
        "stages": ["--stage-urls", f"0={tts.urls[0][0]},1={tts.urls[1][0]}", "--msgpack"],
        "discovery": ["--control-plane", tts.cp.url],
    }
    wavs = {}
    for name, args in ways.items():
        out = tmp_path / f"{name}.wav"
        result = _omni_run(tmp_path, *args, "-o", str(out))
        assert result.returncode == 0, result.stderr
        assert "[1/2]" in result.stdout and "[2/2]" in result.stdout, result.stdout
        wavs[name] = out.read_bytes()
    assert wavs["api"] == wavs["stages"] == wavs["discovery"]
    # The orchestrated path gives the same bytes for the same seed.
    status, body = post_json(
        tts.api_url + "/v1/audio/speech",
        {"model": "tiny-tts", "input": "The same words.", "voice": "nova", "seed": 99},
    )
    assert status == 200 and body == wavs["api"]


def test_omni_run_reports_a_bad_stage_url(tts: Topology, tmp_path: Path) -> None:
    result = _omni_run(tmp_path, "--stage-urls", f"0={tts.urls[1][0]},1={tts.urls[1][0]}")
    assert result.returncode == 1
    assert "stage" in result.stderr.lower()


def test_secret_mismatch_is_a_clear_400(tts: Topology, tmp_path: Path) -> None:
    """An envelope sealed by another deployment (another secret) is refused, not run."""
    import base64

    from omni_mesh.configs.registry import get_pipeline
    from omni_mesh.data_plane.envelope import seal
    from omni_mesh.data_plane.messages import Payload, StageInput

    si = StageInput(
        pipeline="tiny-tts", request_id="forged", stage_id=1, deadline_ms=2**40, seed=1,
        payload=Payload(fields={"x": 1}),
    )  # fmt: skip
    assert get_pipeline("tiny-tts").stage(1)
    forged = base64.urlsafe_b64encode(seal(si, b"another-secret-entirely")).decode()
    status, body = post_json(tts.api_url + "/v1/run", {"stage_id": 1, "stage_input": forged})
    assert status == 400 and b"tag" in body
    assert SECRET  # the deployment's own secret is different
