"""A split stage's KV transfer totals, reported by the engine (``EngineStats``), as counter
increments at scrape time."""

from __future__ import annotations

from omni_mesh.data_plane.messages import EngineStats
from omni_mesh.observability.metrics import SidecarMetrics


class EngineKvCounts:
    """The totals last exported; each scrape adds what grew since (an engine that restarted
    counts from zero again)."""

    def __init__(self) -> None:
        self._last = (0, 0, 0, 0)
        self._last_s = 0.0

    def update(self, metrics: SidecarMetrics, labels: tuple[str, str], stats: EngineStats) -> None:
        now = (stats.kv_pulled, stats.kv_pull_failed, stats.kv_expired, stats.kv_pulled_bytes)
        grown = [n - o if n >= o else n for n, o in zip(now, self._last, strict=True)]
        self._last = now
        for outcome, n in zip(("pulled", "failed", "expired"), grown, strict=False):
            child = metrics.kv_transfers.labels(*labels, outcome)  # every outcome shown, 0 too
            if n:
                child.inc(n)
        if grown[3]:
            metrics.kv_transfer_bytes.labels(*labels).inc(grown[3])
        seconds = stats.kv_pulled_s
        grown_s = seconds - self._last_s if seconds >= self._last_s else seconds
        self._last_s = seconds
        if grown_s > 0:
            metrics.kv_transfer_seconds.labels(*labels).inc(grown_s)
