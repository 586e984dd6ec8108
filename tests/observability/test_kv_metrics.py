"""A split stage's engine figures at scrape time (``observability/kv_metrics.py``): the
queued prefill tokens as a gauge, the transfer totals as counter increments."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from omni_mesh.data_plane.messages import EngineStats
from omni_mesh.observability.kv_metrics import KvMetrics

pytestmark = pytest.mark.unit

LABELS = ("tiny-llm", "0")


def stats(queued: int, pulled: int) -> EngineStats:
    return EngineStats(
        running=0,
        waiting=0,
        kv_cache_usage=0.0,
        tokens_per_s=0.0,
        kv_pulled=pulled,
        prefill_tokens_queued=queued,
    )


def test_export_sets_the_queued_prefill_tokens_and_adds_what_the_totals_grew_by() -> None:
    registry = CollectorRegistry()
    kv = KvMetrics(registry)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"pipeline": "tiny-llm", "stage": "0", **labels})

    kv.export_engine(LABELS, stats(queued=4096, pulled=2))
    assert value("omni_stage_prefill_tokens_queued") == 4096
    assert value("omni_stage_kv_transfers_total", outcome="pulled") == 2
    kv.export_engine(LABELS, stats(queued=0, pulled=5))
    assert value("omni_stage_prefill_tokens_queued") == 0  # a gauge: now, not a total
    assert value("omni_stage_kv_transfers_total", outcome="pulled") == 5
