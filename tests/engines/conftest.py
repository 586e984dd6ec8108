"""Engine tests run torch on one thread: deterministic and fair to the other tests' cores.
``make_client`` starts real engine processes and checks that they leave no shared memory."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.data_plane.shm import SHM_DIR
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
