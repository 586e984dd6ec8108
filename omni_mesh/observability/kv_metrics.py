"""A split stage's metrics (deploy ``prefill:``): the senders' KV hand-offs, the KV
transfers an engine reports as totals in ``EngineStats``, turned into counter increments at
scrape time, and the prompt tokens it has not prefilled yet (:meth:`KvMetrics.export_engine`)."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

SC_KV_HANDOFFS = "omni_stage_kv_handoffs"
SC_KV_TRANSFERS = "omni_stage_kv_transfers"
SC_KV_TRANSFER_BYTES = "omni_stage_kv_transfer_bytes"
SC_KV_TRANSFER_SECONDS = "omni_stage_kv_transfer_seconds"
SC_PREFILL_TOKENS_QUEUED = "omni_stage_prefill_tokens_queued"
#: ``EngineStats`` totals by the outcome they count (``omni_stage_kv_transfers_total``).
_OUTCOMES = {"pulled": "kv_pulled", "failed": "kv_pull_failed", "expired": "kv_expired"}


class KvTotals(Protocol):
    """What an engine reports of its KV transfers, as totals since it started (the engine's
    stats message has these fields; observability imports nothing of the data plane)."""

    @property
    def prefill_tokens_queued(self) -> int: ...
    @property
    def kv_pulled(self) -> int: ...
    @property
    def kv_pull_failed(self) -> int: ...
    @property
    def kv_expired(self) -> int: ...
    @property
    def kv_pulled_bytes(self) -> int: ...
    @property
    def kv_pulled_s(self) -> float: ...


class KvMetrics:
    """The split-stage metrics of one pod, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handoffs = Counter(
            SC_KV_HANDOFFS,
            "Hops to a split stage by how its prompt was prefilled: remote (on a prefill "
            "replica, the KV pulled by the decode replica) or local (no prefill replica could: "
            "the decode replica prefilled).",
            ["pipeline", "from_stage", "to_stage", "outcome"],
            registry=registry,
        )
        self.transfers = Counter(
            SC_KV_TRANSFERS,
            "A split stage's KV transfers seen by this replica's engine: pulled (a decode "
            "replica read a prefill replica's KV), failed (the pull failed: the decode replica "
            "prefilled for itself), expired (a prefill replica freed KV nobody pulled).",
            ["pipeline", "stage", "outcome"],
            registry=registry,
        )
        self.transfer_bytes = Counter(
            SC_KV_TRANSFER_BYTES,
            "Bytes of KV cache a decode replica's engine pulled from prefill replicas.",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.transfer_seconds = Counter(
            SC_KV_TRANSFER_SECONDS,
            "Time a decode replica's engine spent in KV pulls (NIXL's transfer time).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self.prefill_tokens_queued = Gauge(
            SC_PREFILL_TOKENS_QUEUED,
            "Prompt tokens this replica's engine holds and has not prefilled yet (what it "
            "reports in its heartbeats; the senders pick a prefill replica by it).",
            ["pipeline", "stage"],
            registry=registry,
        )
        self._exported: dict[str, float] = {}  # the engine's totals at the last scrape

    def export_engine(self, labels: tuple[str, str], stats: KvTotals) -> None:
        """Add what the engine's totals grew by since the last scrape (an engine that
        restarted counts from zero again; every outcome is shown, 0 too), and set its queued
        prefill tokens."""
        self.prefill_tokens_queued.labels(*labels).set(stats.prefill_tokens_queued)
        for outcome, field in _OUTCOMES.items():
            child = self.transfers.labels(*labels, outcome)
            if grown := self._grown(field, getattr(stats, field)):
                child.inc(grown)
        if grown := self._grown("kv_pulled_bytes", stats.kv_pulled_bytes):
            self.transfer_bytes.labels(*labels).inc(grown)
        if grown := self._grown("kv_pulled_s", stats.kv_pulled_s):
            self.transfer_seconds.labels(*labels).inc(grown)

    def _grown(self, field: str, total: float) -> float:
        last = self._exported.get(field, 0.0)
        self._exported[field] = total
        return total - last if total >= last else total
