"""Bad vLLM settings stop ``omni-stage`` with exit 2 and one line naming the key, before vLLM
builds anything: an unknown engine argument, a model that is neither a tiny model nor a folder,
and a stage field given as an engine argument.

One real ``omni-stage`` (the unknown argument: its engine process imports vLLM, ~10 s, to know
the argument names) shows the whole way, exit 2 and one line without a traceback. The other two
are found before vLLM is imported, by the same check the engine process runs first
(``build_engine_args``): here, in-process, instead of two more pods and engine processes
competing for the 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.engines.base import EngineConfigError
from omni_mesh.engines.vllm.args import build_engine_args
from tests.procs import clean_env, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

UNKNOWN = (
    {"max_num_batched_tokenz": 512},
    "engine_args.max_num_batched_tokenz: not a vLLM engine argument "
    "(did you mean 'max_num_batched_tokens'?)",
)
EARLY = {
    "missing-model": (
        {"model": "/nonexistent/omni-model"},
        "engine_args.model: model '/nonexistent/omni-model' is neither a tiny model",
    ),
    "stage-field": (
        {"max_model_len": 128},
        "engine_args.max_model_len: set the stage field 'max_model_len' instead",
    ),
}


def test_an_unknown_engine_arg_exits_2_with_one_line(vllm_env: dict[str, str]) -> None:
    overrides = json.dumps({"0": {"engine_args": UNKNOWN[0]}})
    argv = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "tiny-llm",
            "--stage-id", "0", "--headless", "--port", str(free_port()),
            "--stage-overrides", overrides]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    try:
        _, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, stderr[-2000:]
    assert UNKNOWN[1] in stderr, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("name", sorted(EARLY))
def test_settings_wrong_before_vllm_is_imported_name_the_key(
    name: str, vllm_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_vllm() -> None:
        raise AssertionError("the check reached vLLM's argument names (an import of seconds)")

    monkeypatch.setattr("omni_mesh.engines.vllm.args.engine_arg_fields", no_vllm)
    args, needle = EARLY[name]
    base = load_deploy_config(None, get_pipeline("tiny-llm")).stage(0)
    config = base.model_copy(update={"engine_args": {**base.engine_args, **args}})
    cache = Path(vllm_env["XDG_CACHE_HOME"]) / "omni-mesh" / "models"
    with pytest.raises(EngineConfigError) as caught:
        build_engine_args(config, cache)
    message = str(caught.value)
    assert needle in message and "\n" not in message
