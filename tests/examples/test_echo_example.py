"""The custom-pipeline example (examples/echo_pipeline) runs with the README's one command:
omni-up imports the user's module in every process (engines included), the user's engine classes
serve /v1/generate, omni-run drives it through /v1/run, and everything stops cleanly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import ManagedProcess, clean_env, free_port
from tests.sidecar.topology import post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MODULE = "examples.echo_pipeline.pipeline"


def readme_command(port: int) -> list[str]:
    """The README's command line (its `--port 8000` replaced by a free port)."""
    readme = (ROOT / "examples" / "echo_pipeline" / "README.md").read_text()
    block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    words = block.replace("\\\n", " ").split()
    assert words[0] == "PYTHONPATH=$PWD" and words[1] == "omni-up", block
    words[words.index("--port") + 1] = str(port)
    return [str(BIN / "omni-up"), *words[2:]]


@pytest.fixture(scope="module")
def echo_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagedProcess, int]]:
    before = shm_segments()
    port = free_port()
    env = clean_env({"PYTHONPATH": str(ROOT)})
    log_dir = tmp_path_factory.mktemp("echo")
    up = ManagedProcess(readme_command(port), name="omni-up", env=env, cwd=ROOT, log_dir=log_dir)
    up.start()
    try:
        up.wait_for_output(r"omni-up ready", timeout=120)
        yield up, port
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, up.describe()
    finally:
        up.cleanup()
    assert shm_segments() - before == set()


def test_generate_runs_the_users_engines(echo_up: tuple[ManagedProcess, int]) -> None:
    _, port = echo_up
    status, body = post_json(
        f"http://127.0.0.1:{port}/v1/generate", {"prompt": "hi", "max_tokens": 3}
    )
    assert status == 200, body
    assert json.loads(body)["outputs"]["1"]["text"] == "HI! HI! HI!", body


def test_omni_run_loads_the_module_too(echo_up: tuple[ManagedProcess, int]) -> None:
    _, port = echo_up
    argv = [str(BIN / "omni-run"), "--pipeline-module", MODULE, "--pipeline", "echo",
            "--url", f"http://127.0.0.1:{port}", "--prompt", "ok", "--max-tokens", "2"]  # fmt: skip
    env = clean_env({"PYTHONPATH": str(ROOT)})
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "OK! OK!" in done.stdout


def test_without_the_module_the_pipeline_is_unknown() -> None:
    done = subprocess.run(
        [str(BIN / "omni-up"), "--pipeline", "echo"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown pipeline 'echo'" in done.stderr, done.stderr
