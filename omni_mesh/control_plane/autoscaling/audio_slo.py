"""The pipeline's audio SLOs as its API servers report them: each one's heartbeat carries a
snapshot of its last seconds of streamed audio answers in buckets, their time to first audio
(``first_audio_le_<s>``, ``first_audio_count``) and their real-time factor (``rtf_le_<x>``,
``rtf_count``; :data:`~omni_mesh.control_plane.schema.ENGINE_FIRST_AUDIO_LE`). The autoscaler
merges the servers' windows and reads the first audio's p95 (``autoscale:
target_first_audio_p95_ms``) and the real-time factor's p5 (``target_realtime_factor_p5``).
Pure, no IO.

The figures are the pipeline's, measured where the client's audio leaves, not one stage's: a
pool that targets them (the talker's, say) grows while the whole pipeline misses them. Below
:data:`MIN_SAMPLES` answers in the merged windows there is no figure (a p95 of a handful of
answers is one slow answer).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from omni_mesh.control_plane.schema import (
    ENGINE_FIRST_AUDIO_COUNT,
    ENGINE_FIRST_AUDIO_LE,
    ENGINE_RTF_COUNT,
    ENGINE_RTF_LE,
    InstanceInfo,
)
from omni_mesh.observability.window_histogram import bucket_quantile, merge_cumulative

#: Fewest answers in the API servers' windows together for a quantile.
MIN_SAMPLES = 20
#: The quantile each target is on: first audio's p95 (high is late), the real-time factor's p5
#: (low falls behind playback).
FIRST_AUDIO_QUANTILE = 0.95
RTF_QUANTILE = 0.05


def reported_window(
    engine: Mapping[str, float], prefix: str, count: str
) -> tuple[list[tuple[float, int]], int] | None:
    """One API server's reported window of one figure (``prefix`` bounds and ``count``): its
    cumulative counts by bound and its total; None when it reports none (no answer in its
    window, or a server that predates the figures)."""
    total = engine.get(count)
    if total is None or not math.isfinite(total) or total <= 0:
        return None
    cumulative: list[tuple[float, int]] = []
    for name, value in engine.items():
        if not name.startswith(prefix):
            continue
        try:
            bound = float(name[len(prefix) :])
        except ValueError:
            continue  # not a bound: ignored, as any figure this release does not know
        if bound > 0 and math.isfinite(bound) and 0 <= value <= total:
            cumulative.append((bound, int(value)))
    cumulative.sort()
    return cumulative, int(total)


def merged_quantile(
    api_servers: Iterable[InstanceInfo], prefix: str, count: str, q: float
) -> tuple[float | None, int]:
    """(the ``q`` quantile or None, answers) of one figure over the merged windows."""
    windows = [
        w for i in api_servers if (w := reported_window(i.load.engine, prefix, count)) is not None
    ]
    cumulative, total = merge_cumulative(windows)
    if total < MIN_SAMPLES:
        return None, total
    return bucket_quantile(q, cumulative, total), total


def first_audio_p95(api_servers: Iterable[InstanceInfo]) -> tuple[float | None, int]:
    """(p95 ms or None, answers): the time to first audio of ``api_servers``' windows."""
    p95, total = merged_quantile(
        api_servers, ENGINE_FIRST_AUDIO_LE, ENGINE_FIRST_AUDIO_COUNT, FIRST_AUDIO_QUANTILE
    )
    return (None if p95 is None else p95 * 1000.0), total


def realtime_factor_p5(api_servers: Iterable[InstanceInfo]) -> tuple[float | None, int]:
    """(p5 or None, answers): the real-time factor of ``api_servers``' windows."""
    return merged_quantile(api_servers, ENGINE_RTF_LE, ENGINE_RTF_COUNT, RTF_QUANTILE)
