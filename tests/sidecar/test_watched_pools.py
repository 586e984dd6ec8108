"""The router's view of the watch cache (``sidecar/app.py`` WatchedPools): each stage's
replicas are built once per snapshot the watcher holds, and a new snapshot (new members, new
loads, new labels) is seen at once."""

from __future__ import annotations

from typing import Any

import pytest

from omni_mesh.control_plane.schema import InstanceInfo, InstanceState, LoadReport, PipelineSnapshot
from omni_mesh.sidecar.app import WatchedPools
from omni_mesh.sidecar.hop.prefill_tokens import PREFILL_TOKENS_QUEUED

pytestmark = pytest.mark.unit


def info(name: str, in_flight: int = 0, kv_role: str = "") -> InstanceInfo:
    return InstanceInfo(
        instance_id=name,
        pipeline="tiny-llm",
        stage_id=0,
        address=f"http://127.0.0.1:{9000 + len(name)}",
        host_id="h",
        capacity=4,
        labels={"kv_role": kv_role} if kv_role else {},
        state=InstanceState.HEALTHY,
        epoch=1,
        registered_at_ms=0,
        last_heartbeat_ms=0,
        heartbeat_age_ms=0,
        load=LoadReport(in_flight=in_flight),
    )


class FakeWatcher:
    """The far side of one boundary: the watch cache's snapshot and its reader."""

    def __init__(self) -> None:
        self.snapshot: PipelineSnapshot | None = None

    def healthy(self, stage_id: int) -> tuple[InstanceInfo, ...]:
        return () if self.snapshot is None else self.snapshot.healthy(stage_id)


def test_replicas_are_built_once_per_snapshot_and_follow_a_new_one() -> None:
    watcher = FakeWatcher()
    pools = WatchedPools(watcher)  # type: ignore[arg-type]
    assert tuple(pools.replicas(0)) == ()
    watcher.snapshot = PipelineSnapshot(pipeline="tiny-llm", version=1, stages={0: (info("a"),)})
    first: Any = pools.replicas(0)
    assert [r.instance_id for r in first] == ["a"] and pools.replicas(0) is first
    # The same version with new loads and a new member (a heartbeat answer): rebuilt.
    watcher.snapshot = PipelineSnapshot(
        pipeline="tiny-llm", version=1, stages={0: (info("a", 3), info("p", kv_role="prefill"))}
    )
    again = list(pools.replicas(0))
    assert [(r.instance_id, r.reported_in_flight, r.kv_role) for r in again] == [
        ("a", 3, ""),
        ("p", 0, "prefill"),
    ]


def test_a_prefill_replicas_reported_queued_tokens_reach_its_replica() -> None:
    watcher = FakeWatcher()
    pools = WatchedPools(watcher)  # type: ignore[arg-type]
    queued = info("p", kv_role="prefill").model_copy(
        update={"load": LoadReport(in_flight=1, engine={PREFILL_TOKENS_QUEUED: 4096.0})}
    )
    watcher.snapshot = PipelineSnapshot(
        pipeline="tiny-llm", version=1, stages={0: (queued, info("d", kv_role="decode"))}
    )
    got = [(r.instance_id, r.reported_prefill_tokens) for r in pools.replicas(0)]
    assert got == [("p", 4096), ("d", 0)]  # an older peer's load has no such figure: 0
