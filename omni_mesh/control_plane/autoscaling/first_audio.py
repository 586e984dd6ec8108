"""The pipeline's time to first audio as its API servers report it: each one's heartbeat carries
a snapshot of its last seconds of answers in buckets (``first_audio_le_<s>``,
``first_audio_count``: :data:`~omni_mesh.control_plane.schema.ENGINE_FIRST_AUDIO_LE`); the
autoscaler merges them and reads the p95 (``autoscale: target_first_audio_p95_ms``). Pure, no IO.

The figure is the pipeline's, measured where the client's audio leaves, not one stage's: a pool
that targets it (the talker's, say) grows while the whole pipeline's first audio misses it.
Below :data:`MIN_SAMPLES` answers in the merged windows there is no figure (a p95 of a handful
of answers is one slow answer).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from omni_mesh.control_plane.schema import (
    ENGINE_FIRST_AUDIO_COUNT,
    ENGINE_FIRST_AUDIO_LE,
    InstanceInfo,
)
from omni_mesh.observability.window_histogram import bucket_quantile, merge_cumulative

#: Fewest answers in the API servers' windows together for a first-audio p95.
MIN_SAMPLES = 20
#: The quantile the target is on.
QUANTILE = 0.95
#: The registration labels of an instance that serves the client API (``role``).
API_ROLES = frozenset({"api", "api-only"})


def first_audio_window(engine: Mapping[str, float]) -> tuple[list[tuple[float, int]], int] | None:
    """One API server's reported window: its cumulative counts by bound and its total; None
    when it reports none (no answer in its window, or a server that predates the figures)."""
    total = engine.get(ENGINE_FIRST_AUDIO_COUNT)
    if total is None or not math.isfinite(total) or total <= 0:
        return None
    cumulative: list[tuple[float, int]] = []
    for name, value in engine.items():
        if not name.startswith(ENGINE_FIRST_AUDIO_LE):
            continue
        try:
            bound = float(name[len(ENGINE_FIRST_AUDIO_LE) :])
        except ValueError:
            continue  # not a bound: ignored, as any figure this release does not know
        if bound > 0 and math.isfinite(bound) and 0 <= value <= total:
            cumulative.append((bound, int(value)))
    cumulative.sort()
    return cumulative, int(total)


def first_audio_p95(api_servers: Iterable[InstanceInfo]) -> tuple[float | None, int]:
    """(p95 ms or None, answers): the merged windows of ``api_servers`` (module docstring)."""
    windows = [w for i in api_servers if (w := first_audio_window(i.load.engine)) is not None]
    cumulative, total = merge_cumulative(windows)
    if total < MIN_SAMPLES:
        return None, total
    p95 = bucket_quantile(QUANTILE, cumulative, total)
    return (None if p95 is None else p95 * 1000.0), total
