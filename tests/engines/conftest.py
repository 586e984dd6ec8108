"""Engine tests run torch on one thread: deterministic and fair to the other tests' cores.
``make_client`` starts real engine processes and checks that they leave no shared memory.

vLLM tests share one temporary home (``vllm_env``): the tiny models are built there once per
session, and every process they start (engine processes, ``omni-stage``, ``omni-cp``) finds them
there and writes vLLM's caches and IPC files there. Removed at the end: nothing is left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.data_plane.shm import SHM_DIR
from omni_mesh.engines.vllm.tiny_models import TINY_MODELS
from tests.engines.process_helpers import MakeClient, RecordingClient, shm_files, stage_config


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    """``await make(config, pipeline=..., stage_id=..., start=True, async_chunk=False)`` → an
    EngineClient (started unless ``start=False``); stopped at teardown, and its engine killed if
    still there. Fails the test if a segment of the sidecar's or the engine's arena is left in
    /dev/shm."""
    clients: list[RecordingClient] = []

    async def make(
        config: StageDeployConfig | None = None,
        *,
        pipeline: str = "synthetic",
        stage_id: int = 1,
        start: bool = True,
        async_chunk: bool = False,
    ) -> RecordingClient:
        client = RecordingClient(
            pipeline,
            stage_id,
            config or stage_config(1),
            log_level="WARNING",
            async_chunk=async_chunk,
        )
        clients.append(client)
        if start:
            await client.start(timeout_s=30)
        return client

    yield make
    leaked: list[str] = []
    for client in clients:
        await client.stop(timeout_s=5)
        if client.engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(client.engine_pid, signal.SIGKILL)
        leaked += sorted(shm_files(client.arena.prefix) | shm_files(client.engine_prefix))
    assert not leaked, f"segments left in {SHM_DIR}: {leaked}"


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
