"""Typed keys of the omni-cp aiohttp application's state."""

from __future__ import annotations

from aiohttp import web

from omni_mesh.configs.settings import ControlPlaneSettings
from omni_mesh.control_plane.api.hub import ChangeHub
from omni_mesh.control_plane.liveness.suspects import SuspectChecker
from omni_mesh.control_plane.liveness.sweeper import Sweeper
from omni_mesh.control_plane.store.instances import InstanceStore
from omni_mesh.control_plane.store.keys import KeySchema
from omni_mesh.observability.metrics import ControlPlaneMetrics

SETTINGS = web.AppKey("settings", ControlPlaneSettings)
REDIS_URL = web.AppKey("redis_url", str)
KEYS = web.AppKey("keys", KeySchema)
METRICS = web.AppKey("metrics", ControlPlaneMetrics)
STORE = web.AppKey("store", InstanceStore)
HUB = web.AppKey("hub", ChangeHub)
SWEEPER = web.AppKey("sweeper", Sweeper)
SUSPECTS = web.AppKey("suspects", SuspectChecker)
