"""Typed application keys of the sidecar's aiohttp app."""

from __future__ import annotations

from aiohttp import web

from omni_mesh.sidecar.pod import Pod

POD: web.AppKey[Pod] = web.AppKey("pod", Pod)
