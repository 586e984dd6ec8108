"""vLLM tests share one temporary home: the tiny models are built there once per session, and
every process they start (engine processes, ``omni-stage``, ``omni-cp``) finds them there and
writes vLLM's caches and IPC files there. Removed at the end: nothing is left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_mesh.engines.vllm.tiny_models import TINY_MODELS
from tests.engines.vllm.servers import Server, tiny_llm

_BUILD = (
    "import sys; from pathlib import Path; "
    "from omni_mesh.engines.vllm.tiny_models import ensure_tiny_model; "
    "[ensure_tiny_model(n, Path(sys.argv[1])) for n in sys.argv[2:]]"
)


@pytest.fixture(scope="session")
def vllm_env() -> Iterator[dict[str, str]]:
    """The environment for vLLM processes (also set in ``os.environ`` for the session, so that
    engine processes spawned by in-test clients inherit it)."""
    root = Path(tempfile.mkdtemp(prefix="omni-vllm-test-"))
    env = {
        "HOME": str(root / "home"),
        "TMPDIR": str(root / "tmp"),
        "XDG_CACHE_HOME": str(root / "cache"),
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
        # vLLM torch.compiles a few sampler ops (logprobs, top-k/top-p) on first use: ~25 s
        # per fresh process here, every test process being fresh. Eager gives the same numbers.
        "TORCHDYNAMO_DISABLE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key in ("HOME", "TMPDIR", "XDG_CACHE_HOME"):
        Path(env[key]).mkdir(parents=True)
    models = Path(env["XDG_CACHE_HOME"]) / "omni-mesh" / "models"
    subprocess.run(
        [sys.executable, "-c", _BUILD, str(models), *TINY_MODELS],
        check=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, **env},
    )
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llm_server(
    vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One unsplit ``tiny-llm`` for the session (``servers.py``): the OpenAI-route tests and
    the prefill/decode split's reference answers use the same deployment."""
    with tiny_llm(tmp_path_factory.mktemp("vllm-tiny-llm")) as server:
        yield server
