"""The typed async client of the control plane, for sidecars and tools.

- :class:`ControlPlaneClient` - one method per API route, fails over between omni-cp URLs.
- :class:`InstanceLease` - registration + heartbeats of one instance, re-registers on 404.
- :class:`PoolWatcher` - a local cache of a pipeline's healthy pools fed by the watch API.
- :class:`SuspectReporter` - reports replicas a router could not connect to (a router's
  ``on_eject`` callback).
- :class:`SessionsClient` - realtime sessions (create, claim, patch, release, touch), fenced by
  epoch (:class:`SessionFenced`).

Request/response models and errors are re-exported from ``schema`` and ``errors``.
"""

from omni_mesh.control_plane.client.backoff import Backoff
from omni_mesh.control_plane.client.http import ControlPlaneClient
from omni_mesh.control_plane.client.lease import InstanceLease
from omni_mesh.control_plane.client.sessions import SessionsClient
from omni_mesh.control_plane.client.suspects import SuspectReporter
from omni_mesh.control_plane.client.watcher import ChangeListener, PoolWatcher
from omni_mesh.control_plane.errors import (
    ControlPlaneAuthError,
    ControlPlaneError,
    ControlPlaneRequestError,
    ControlPlaneUnavailableError,
    EndpointFailure,
    InstanceUnknownError,
    SessionFenced,
    SessionNotFound,
)
from omni_mesh.control_plane.schema import (
    ENGINE_FIRST_AUDIO_COUNT,
    ENGINE_FIRST_AUDIO_LE,
    ENGINE_OCCUPANCY,
    ENGINE_QUEUE_WAIT_MS,
    ENGINE_RTF_COUNT,
    ENGINE_RTF_LE,
    KV_ROLE_LABEL,
    HeartbeatAck,
    InstanceInfo,
    InstanceState,
    LoadReport,
    PipelineList,
    PipelineSnapshot,
    PipelineStatus,
    PoolSnapshot,
    ProbeOutcome,
    RegisterRequest,
    Registration,
    ScaleDecision,
    ScaleDirection,
    ScaleInputs,
    ScalePool,
    ScaleStatus,
    SuspectResult,
)
from omni_mesh.control_plane.session_schema import (
    SessionCounts,
    SessionItem,
    SessionState,
    SessionSummary,
    SessionTouchResult,
)

__all__ = [
    "ENGINE_FIRST_AUDIO_COUNT",
    "ENGINE_FIRST_AUDIO_LE",
    "ENGINE_OCCUPANCY",
    "ENGINE_QUEUE_WAIT_MS",
    "ENGINE_RTF_COUNT",
    "ENGINE_RTF_LE",
    "KV_ROLE_LABEL",
    "Backoff",
    "ChangeListener",
    "ControlPlaneAuthError",
    "ControlPlaneClient",
    "ControlPlaneError",
    "ControlPlaneRequestError",
    "ControlPlaneUnavailableError",
    "EndpointFailure",
    "HeartbeatAck",
    "InstanceInfo",
    "InstanceLease",
    "InstanceState",
    "InstanceUnknownError",
    "LoadReport",
    "PipelineList",
    "PipelineSnapshot",
    "PipelineStatus",
    "PoolSnapshot",
    "PoolWatcher",
    "ProbeOutcome",
    "RegisterRequest",
    "Registration",
    "ScaleDecision",
    "ScaleDirection",
    "ScaleInputs",
    "ScalePool",
    "ScaleStatus",
    "SessionCounts",
    "SessionFenced",
    "SessionItem",
    "SessionNotFound",
    "SessionState",
    "SessionSummary",
    "SessionTouchResult",
    "SessionsClient",
    "SuspectReporter",
    "SuspectResult",
]
