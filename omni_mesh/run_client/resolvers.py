"""Where each ``/v1/run`` call goes: a :class:`StageResolver` gives the base URL of an instance
that runs a stage — :class:`FixedUrls` (API servers, which accept every stage and forward),
:class:`StageUrls` (one URL per stage) or :class:`ControlPlaneDiscovery` (a healthy replica of
the stage, found through ``omni-cp``)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from omni_mesh.control_plane.client import ControlPlaneClient, ControlPlaneError
from omni_mesh.run_client.errors import DiscoveryError


class StageResolver(Protocol):
    async def url_for(self, stage_id: int) -> str:
        """Base URL (``http://host:port``) of an instance that runs ``stage_id``."""
        ...

    async def close(self) -> None:
        """Release what the resolver holds (the client closes its resolver)."""
        ...


class FixedUrls:
    """Every call goes to one of a few API servers, round robin."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("need at least one URL")
        self._next = itertools.cycle([u.rstrip("/") for u in urls])

    async def url_for(self, stage_id: int) -> str:
        return next(self._next)

    async def close(self) -> None:
        return None


class StageUrls:
    """Stage k's calls go to its own URL."""

    def __init__(self, urls: Mapping[int, str]) -> None:
        self._urls = {k: u.rstrip("/") for k, u in urls.items()}

    async def url_for(self, stage_id: int) -> str:
        try:
            return self._urls[stage_id]
        except KeyError:
            raise DiscoveryError(f"no URL given for stage {stage_id}") from None

    async def close(self) -> None:
        return None


class ControlPlaneDiscovery:
    """A random healthy replica of the stage, asked of the control plane for every call
    (``GET /v1/pipelines/{p}/stages/{k}/instances``; several omni-cp URLs fail over)."""

    def __init__(
        self,
        control_plane: str | Sequence[str],
        pipeline: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._client = ControlPlaneClient(control_plane, auth_token=token, timeout_s=timeout_s)
        self._pipeline = pipeline

    async def url_for(self, stage_id: int) -> str:
        try:
            pool = await self._client.instances(self._pipeline, stage_id)
        except ControlPlaneError as exc:
            raise DiscoveryError(f"discovery of stage {stage_id}: {exc}") from exc
        if not pool.instances:
            raise DiscoveryError(
                f"no healthy replica of stage {stage_id} of pipeline {self._pipeline!r} "
                f"is registered at {', '.join(self._client.urls)}"
            )
        return random.choice(pool.instances).address.rstrip("/")

    async def close(self) -> None:
        await self._client.close()
