"""The streamed audio answers of one client request, measured as a listener plays them
(``observability/audio_slo.py``): one :class:`AudioPlayback` per choice, fed by the route's sink
as it sends audio, recorded in ``/metrics`` when the request ends and set on each choice's span."""

from __future__ import annotations

import time

from aiohttp import web

from omni_mesh.observability.audio_slo import AudioPlayback, AudioSloMetrics
from omni_mesh.observability.tracing import LateAttributes
from omni_mesh.sidecar.middleware import API_ROUTE, API_STARTED


class Playbacks:
    """The audio answers of one request (module docstring): arrived at ``started``
    (``time.monotonic()``) on ``route`` for ``tenant``."""

    def __init__(self, started: float, route: str, tenant: str = "") -> None:
        self.started = started
        self.route = route
        self.tenant = tenant
        self._choices: dict[int, AudioPlayback] = {}

    @classmethod
    def of_request(cls, request: web.Request, tenant: str) -> Playbacks:
        started = request.get(API_STARTED) or time.monotonic()
        return cls(started, request.get(API_ROUTE, request.path), tenant)

    def of(self, index: int = 0) -> AudioPlayback:
        playback = self._choices.get(index)
        if playback is None:
            playback = self._choices[index] = AudioPlayback(started=self.started)
        return playback

    def attributes(self, index: int = 0) -> LateAttributes:
        """Choice ``index``'s figures as its span's late attributes."""
        return self.of(index).attributes

    def sent(self, samples: int, rate: int, index: int = 0) -> None:
        """``samples`` at ``rate`` of choice ``index`` went to the client now."""
        if samples > 0 and rate > 0:
            self.of(index).sent(samples / rate, time.monotonic())

    def record(self, metrics: AudioSloMetrics, pipeline: str) -> None:
        """Every choice that sent audio, into ``metrics`` (once each)."""
        for playback in self._choices.values():
            metrics.record(playback, pipeline, self.route, self.tenant)
