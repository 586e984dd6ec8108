"""A process's garbage collector (``sidecar/gc_pacer.py``): how long each pass paused it, and
why the paced full passes ran. Every pod registers these (``SidecarMetrics.gc``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

GC_PAUSE = "omni_process_gc_pause_seconds"
GC_PACED = "omni_process_gc_paced_collections"
GC_FROZEN = "omni_process_gc_frozen_objects"

# GC pause buckets (seconds): 50 us .. 250 ms.
GC_PAUSE_BUCKETS: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
)


class ProcessGcMetrics:
    """The collector's passes in one process: how long each paused it, why the paced ones ran."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.pause = Histogram(
            GC_PAUSE,
            "Garbage-collector passes by generation and how long each stopped the process.",
            ["generation"],
            buckets=GC_PAUSE_BUCKETS,
            registry=registry,
        )
        self.paced = Counter(
            GC_PACED,
            "Collector passes the pacer ran, by reason: full passes (idle, idle_unfreeze, busy, "
            "frozen_cap) and young ones (young: every gc_young_pass_s while busy).",
            ["reason"],
            registry=registry,
        )
        self.frozen = Gauge(
            GC_FROZEN,
            "Objects kept out of every collection (gc.freeze): start-up objects and the "
            "survivors of busy full passes until the next idle moment.",
            registry=registry,
        )
