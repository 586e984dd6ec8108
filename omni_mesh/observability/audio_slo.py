"""Audio SLOs of streamed answers, measured where the client's bytes leave: the API server.

For every streamed audio answer (``/v1/audio/speech`` streamed, ``/v1/chat/completions`` with
audio and ``stream: true``, each realtime response) an :class:`AudioPlayback` follows the audio
as a listener plays it:

- **time to first audio**: from the request's arrival to its first audio bytes sent;
- **real-time factor**: the answer's audio seconds over the wall seconds from the request's
  arrival to its last audio bytes (above 1: made faster than it plays);
- **underruns**: playback starts with the first bytes; a later chunk that is sent after the audio
  sent before it would have finished playing is an underrun, its gap the time the listener heard
  silence. A player stalls for the gap and goes on from there, so the playback clock moves by the
  gap (one late chunk is one underrun, not one for every chunk after it).

:class:`AudioSloMetrics` records them per pipeline, route and tenant; the request's span carries
them as ``omni.audio.*`` attributes. Tenants are a bounded label (``tenant_labels.py``). It also
keeps the time to first audio and the real-time factor of the last :data:`FIRST_AUDIO_WINDOW_S`
seconds, all routes and tenants together (:attr:`AudioSloMetrics.first_window`,
:attr:`AudioSloMetrics.rtf_window`), which the API server's heartbeats carry for the autoscaler
(``autoscale: target_first_audio_p95_ms``, ``target_realtime_factor_p5``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omni_mesh.observability.tenant_labels import TenantLabels
from omni_mesh.observability.window_histogram import WindowHistogram

SC_AUDIO_FIRST = "omni_api_audio_first_seconds"
SC_AUDIO_RTF = "omni_api_audio_realtime_factor"
SC_AUDIO_SECONDS = "omni_api_audio_seconds"
SC_AUDIO_UNDERRUNS = "omni_api_audio_underruns"
SC_AUDIO_UNDERRUN_SECONDS = "omni_api_audio_underrun_seconds"
SC_STREAM_REALTIME = "omni_stage_stream_realtime_factor"

FIRST_AUDIO_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
#: Seconds of answers the first-audio window holds (what the heartbeats report).
FIRST_AUDIO_WINDOW_S = 10.0
RTF_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 25.0, 100.0)


@dataclass
class AudioPlayback:
    """One streamed audio answer as a listener plays it (module docstring). Times are
    ``time.monotonic()``."""

    started: float  # the request's arrival
    first: float | None = None  # its first audio bytes sent
    last: float = 0.0  # its last audio bytes sent
    audio_s: float = 0.0  # audio sent so far
    underruns: int = 0
    gap_s: float = 0.0  # silence heard, over all underruns
    recorded: bool = field(default=False, repr=False)

    def sent(self, seconds: float, now: float) -> None:
        """``seconds`` of audio went to the client at ``now``."""
        if seconds <= 0:
            return
        if self.first is None:
            self.first = now
        else:
            runs_out = self.first + self.gap_s + self.audio_s  # the audio sent before, played
            if now > runs_out:
                self.underruns += 1
                self.gap_s += now - runs_out
        self.audio_s += seconds
        self.last = now

    @property
    def first_audio_s(self) -> float | None:
        return None if self.first is None else self.first - self.started

    @property
    def realtime_factor(self) -> float | None:
        if self.first is None:
            return None
        return self.audio_s / max(1e-6, self.last - self.started)

    def attributes(self) -> dict[str, float | int]:
        """The span attributes (none before the first audio)."""
        if self.first is None:
            return {}
        return {
            "omni.audio.first_s": round(self.first - self.started, 6),
            "omni.audio.seconds": round(self.audio_s, 6),
            "omni.audio.realtime_factor": round(self.realtime_factor or 0.0, 4),
            "omni.audio.underruns": self.underruns,
            "omni.audio.underrun_s": round(self.gap_s, 6),
        }


class AudioSloMetrics:
    """The API server's audio SLO series (module docstring), registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry, tenants: TenantLabels | None = None) -> None:
        self.tenant_label = tenants or TenantLabels()
        # The last seconds' first audio, every route and tenant (what the heartbeats carry).
        self.first_window = WindowHistogram(FIRST_AUDIO_BUCKETS, FIRST_AUDIO_WINDOW_S)
        self.rtf_window = WindowHistogram(RTF_BUCKETS, FIRST_AUDIO_WINDOW_S)
        labels = ["pipeline", "route", "tenant"]
        self.first = Histogram(
            SC_AUDIO_FIRST,
            "Streamed audio answers: time from the request to its first audio bytes sent.",
            labels,
            buckets=FIRST_AUDIO_BUCKETS,
            registry=registry,
        )
        self.rtf = Histogram(
            SC_AUDIO_RTF,
            "Streamed audio answers: audio seconds over the wall seconds from the request to "
            "its last audio bytes (above 1: made faster than it plays).",
            labels,
            buckets=RTF_BUCKETS,
            registry=registry,
        )
        self.seconds = Counter(
            SC_AUDIO_SECONDS,
            "Seconds of audio streamed to clients.",
            labels,
            registry=registry,
        )
        self.underruns = Counter(
            SC_AUDIO_UNDERRUNS,
            "Playback underruns of streamed audio answers: a chunk sent after the audio sent "
            "before it would have finished playing from the first bytes on.",
            labels,
            registry=registry,
        )
        self.underrun_seconds = Counter(
            SC_AUDIO_UNDERRUN_SECONDS,
            "Silence a listener heard in playback underruns (the gaps, summed).",
            labels,
            registry=registry,
        )
        # A stage pod's, per stage: an audio-frame stage (a talker) against real time.
        self.stream_realtime = Gauge(
            SC_STREAM_REALTIME,
            "An audio-frame stage (a talker): the audio seconds its last step made for each "
            "running stream over that step's duration (below 1: its streams fall behind "
            "playback).",
            ["pipeline", "stage"],
            registry=registry,
        )

    def record(self, playback: AudioPlayback, pipeline: str, route: str, tenant: str) -> None:
        """One finished answer's figures (once; nothing for an answer that sent no audio)."""
        if playback.recorded or playback.first is None:
            return
        playback.recorded = True
        labels = (pipeline, route, self.tenant_label(tenant))
        self.first.labels(*labels).observe(playback.first - playback.started)
        self.first_window.observe(playback.first - playback.started, time.monotonic())
        self.rtf.labels(*labels).observe(playback.realtime_factor or 0.0)
        self.rtf_window.observe(playback.realtime_factor or 0.0, time.monotonic())
        self.seconds.labels(*labels).inc(playback.audio_s)
        self.underruns.labels(*labels).inc(playback.underruns)
        self.underrun_seconds.labels(*labels).inc(playback.gap_s)
