"""Driving a real engine process through :class:`EngineClient`, for the process tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import StageInput, StageOutput
from omni_mesh.data_plane.shm import SHM_DIR
from omni_mesh.sidecar.engine_link.client import EngineClient

MiB = 1 << 20


def stage_config(stage_id: int = 1, **update: Any) -> StageDeployConfig:
    """The bundled synthetic deploy config of ``stage_id``, 1 MiB outputs, ``update`` applied."""
    base = load_deploy_config(None, get_pipeline("synthetic")).stage(stage_id)
    return base.model_copy(update={"output_bytes": MiB, **update})


def shm_files(prefix: str | None) -> set[str]:
    if not prefix:
        return set()
    return {p.name for p in Path(SHM_DIR).iterdir() if p.name.startswith(prefix + "-")}


class RecordingClient(EngineClient):
    """An EngineClient whose ``on_death`` calls are recorded in ``deaths``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.deaths: list[str] = []
        super().__init__(*args, on_death=self.deaths.append, **kwargs)


MakeClient = Callable[..., Awaitable[RecordingClient]]


async def execute(client: EngineClient, si: StageInput) -> StageOutput:
    """Run one request whose output is whole (one chunk) through ``client.stream``."""
    outputs = [out async for out in client.stream(si)]
    if len(outputs) != 1:
        raise RuntimeError(f"request {si.request_id} gave {len(outputs)} chunks; use stream()")
    return outputs[0]
