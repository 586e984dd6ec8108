"""Bad vLLM settings stop ``omni-stage`` with exit 2 and one line naming the key, before vLLM
builds anything: an unknown engine argument, a model that is neither a tiny model nor a folder,
and a stage field given as an engine argument. The pods run at once; only the first imports
vLLM (~10 s) to know its argument names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.procs import clean_env, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CASES = {
    "unknown": (
        {"max_num_batched_tokenz": 512},
        "engine_args.max_num_batched_tokenz: not a vLLM engine argument "
        "(did you mean 'max_num_batched_tokens'?)",
    ),
    "missing-model": (
        {"model": "/nonexistent/omni-model"},
        "engine_args.model: model '/nonexistent/omni-model' is neither a tiny model",
    ),
    "stage-field": (
        {"max_model_len": 128},
        "engine_args.max_model_len: set the stage field 'max_model_len' instead",
    ),
}


def test_bad_engine_args_exit_2_with_one_line(vllm_env: dict[str, str]) -> None:
    procs = {}
    for name, (args, _) in CASES.items():
        overrides = json.dumps({"0": {"engine_args": args}})
        argv = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "tiny-llm",
                "--stage-id", "0", "--headless", "--port", str(free_port()),
                "--stage-overrides", overrides]  # fmt: skip
        procs[name] = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
    for name, proc in procs.items():
        try:
            _, stderr = proc.communicate(timeout=150)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        needle = CASES[name][1]
        assert proc.returncode == 2, f"{name}: {stderr[-2000:]}"
        assert needle in stderr, f"{name}: {stderr[-2000:]}"
        assert "Traceback" not in stderr, f"{name}: {stderr[-2000:]}"
