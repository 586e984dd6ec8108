"""An ``autoscale: target_queue_wait_ms`` through ``omni-up`` with real processes (issue 35,
item 3): stage 1 of the synthetic pipeline runs one 100 ms request at a time and admits one
(``max_num_seqs: 1``, ``max_inflight: 1``), so the requests behind it wait in its admission
queue. Its utilization cannot pass 1.0, and its ``target_utilization: 1.0`` never asks for
more. With its heartbeats reporting how long requests waited before its engine started them
(``LoadReport.engine`` ``queue_wait_ms``), a queue wait above the 50 ms target adds a replica;
when the load is gone, so is the wait, and the pool drains back to one replica."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from tests.launcher.autoscaled import Timeline, Up, autoscaled_up
from tests.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

logger = logging.getLogger(__name__)

TARGET_MS = 50.0

DEPLOY = f"""\
pipeline: synthetic
request_timeout_s: 60
stages:
  - stage_id: 0
    max_num_seqs: 16
    max_inflight: 64
  - stage_id: 1
    num_replicas: 1
    max_num_seqs: 1
    max_inflight: 1
    step_latency_ms: 100
    autoscale:
      min_replicas: 1
      max_replicas: 2
      target_utilization: 1.0
      target_queue_wait_ms: {TARGET_MS}
      scale_up_window_s: 0.5
      scale_down_window_s: 2
      cooldown_s: 0.5
  - stage_id: 2
    max_num_seqs: 16
    max_inflight: 64
"""


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    env = {"OMNI_CP_HEARTBEAT_INTERVAL_MS": "250"}
    with autoscaled_up(DEPLOY, tmp_path_factory.mktemp("queue_wait"), env) as up:
        yield up


def test_a_queue_wait_past_its_target_adds_a_replica_and_the_pool_drains_back(up: Up) -> None:
    wait_until(lambda: (s := up.sample()).ready == 1 and s.desired == 1, 30,
               interval=0.2, message=lambda: str(up.scale()))  # fmt: skip
    stop = threading.Event()
    statuses: list[int] = []

    def client(worker: int) -> None:  # closed loop: one request at a time per worker
        seed = worker * 100_000
        while not stop.is_set():
            status, body = up.generate(seed)
            statuses.append(status)
            assert status == 200, body[:300]
            seed += 1

    with Timeline(up) as timeline:
        workers = [threading.Thread(target=client, args=(w,)) for w in range(3)]
        for w in workers:
            w.start()
        try:
            wait_until(lambda: up.sample().ready == 2, 40, interval=0.2,
                       message=timeline.changes)  # fmt: skip
        finally:
            stop.set()
            for w in workers:
                w.join(60)
        loaded = len(timeline.samples)
        wait_until(lambda: (s := up.sample()).desired == 1 and s.pods == 1, 40,
                   interval=0.2, message=timeline.changes)  # fmt: skip
    logger.info("3 clients, then none:\n%s", timeline.changes())
    assert statuses and set(statuses) == {200}, statuses
    during = timeline.samples[:loaded]
    # The wait asked for the replica: the first decision for 2 names it, with the wait past
    # the target; the utilization alone never could.
    first = next(s for s in during if s.desired == 2)
    assert first.reason == "queue_wait", timeline.changes()
    assert first.queue_wait_ms is not None and first.queue_wait_ms > TARGET_MS, first
    assert max(s.utilization for s in during) <= 1.0 + 1e-9, timeline.changes()
    # Drained back with the load gone: the last decisions saw no wait.
    assert timeline.samples[-1].queue_wait_ms in (0.0, None), timeline.changes()
