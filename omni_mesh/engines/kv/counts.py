"""What a split stage's engine moved over NIXL, as totals since it started: reported to the
sidecar in ``EngineStats`` (``kv_pulled``, …) and exported by it as
``omni_stage_kv_transfers_total{outcome}`` and friends (``observability/kv_metrics.py``).
The vLLM engine reads them off vLLM's connector (``vllm/kv_split.py``), the transformers
engines count their own (``exchange.py``)."""

from __future__ import annotations

from typing import Any


class KvCounts:
    """Pulls and their bytes and transfer time (a decode replica's reads), pulls that failed
    (the decode replica prefilled for itself instead), and prefilled KV that no decode replica
    pulled before its lease ran out (a prefill replica freed it)."""

    def __init__(self) -> None:
        self.pulled = 0
        self.pulled_bytes = 0
        self.pulled_s = 0.0
        self.failed = 0
        self.expired = 0

    def stats_fields(self) -> dict[str, Any]:
        """The ``EngineStats`` fields of these totals."""
        return {
            "kv_pulled": self.pulled,
            "kv_pulled_bytes": self.pulled_bytes,
            "kv_pulled_s": self.pulled_s,
            "kv_pull_failed": self.failed,
            "kv_expired": self.expired,
        }
