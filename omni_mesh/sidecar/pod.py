"""The pod: everything one sidecar holds at run time, built in start-up order and torn down in
reverse (engine → READY → register → heartbeat → watch → serve; drain on SIGTERM)."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from omni_mesh.configs.deploy import DeployConfig, StageDeployConfig
from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.configs.stage_settings import StageSettings
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.data_plane.signing import hop_token
from omni_mesh.observability.metrics import SidecarMetrics
from omni_mesh.sidecar.engine_link.client import EngineClient
from omni_mesh.sidecar.hop.client import HopClient
from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.input_stream import InputStreams
from omni_mesh.sidecar.hop.router import Router
from omni_mesh.sidecar.runner import StageRunner

if TYPE_CHECKING:
    from omni_mesh.sidecar.admission.gate import AdmissionGate

logger = logging.getLogger(__name__)


@dataclass
class Pod:
    settings: StageSettings
    pipeline: PipelineSpec
    deploy: DeployConfig
    metrics: SidecarMetrics
    secret: bytes
    router: Router
    hop: HopClient
    http: HopHttpClient
    reader: ShmReader
    engine: EngineClient | None = None
    runner: StageRunner | None = None
    instance_id: str = ""
    ready: bool = False  # listening and registered (or no control plane configured)
    draining: bool = False
    in_flight: int = 0
    admitted: int = 0  # requests admitted since start (the GC pacer's sign of activity)
    gate: AdmissionGate | None = None  # the admission queue (admission.admit.gate_of)
    exit_code: int = 0
    # The streamed inputs this pod's runner holds for the replicas that pull them.
    input_streams: InputStreams = field(default_factory=InputStreams)
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)

    @functools.cached_property
    def hop_token(self) -> str:
        return hop_token(self.secret)

    @property
    def stage_id(self) -> int:
        return self.settings.stage_id

    @functools.cached_property
    def stage_config(self) -> StageDeployConfig:
        return self.deploy.stage(self.settings.stage_id)

    @functools.cached_property
    def in_flight_gauge(self) -> Gauge:
        """This pod's in-flight gauge child (label lookups cost µs on every request)."""
        return self.metrics.in_flight.labels(self.pipeline.name, str(self.stage_id))

    @property
    def serves_api(self) -> bool:
        return not self.settings.headless

    def request_timeout_s(self) -> float:
        return float(self.deploy.request_timeout_s)

    def stop(self, code: int) -> None:
        """Ask the pod to shut down (drain first) and exit with ``code``."""
        self.exit_code = max(self.exit_code, code)
        self.stop_event.set()


def resolve_secret(settings: StageSettings) -> bytes:
    if settings.secret is not None:
        return settings.secret_bytes
    logger.warning(
        "no deployment secret (--secret / OMNI_SECRET): using a random one; stage inputs "
        "returned by /v1/run will be accepted by this instance only"
    )
    return secrets.token_bytes(32)
