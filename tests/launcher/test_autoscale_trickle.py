"""A trickle does not hold an autoscaled stage above ``min_replicas`` (issue 35, item 3), through
``omni-up`` with real processes: stage 1 of the synthetic pipeline runs one 40 ms request at a
time (``max_num_seqs: 1``) and autoscales between 1 and 3 replicas with no scale-up window (one
decision that asks for more adds a replica: the trickle's worst case).

One request a second keeps such a replica busy about 5% of the time. A heartbeat that samples
the requests in flight at one instant catches that request now and then, reads a utilization of
1 (ask for 2 replicas) and holds the scale-down window open; the heartbeats report instead the
engine's work averaged over the time since the previous heartbeat (``LoadReport.engine``
``occupancy``), and the pool stays at 1. Heartbeats come every 250 ms here (the control plane's
``heartbeat_interval_ms``; 1 s by default): four reports a second, so a sampler would catch the
trickle's request within the test's window, and each report still averages over several
times the request's length. A real load still scales the stage up, and a trickle after it brings
it back to 1.

One omni-up serves all tests (module scope): each starts where the one before left off."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator

import pytest

from tests.launcher.autoscaled import Timeline, Up, autoscaled_up
from tests.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

logger = logging.getLogger(__name__)

HEARTBEAT_MS = 250
TRICKLE_S = 20.0  # longer than every window of the policy below, and than a heartbeat x 80

DEPLOY = """\
pipeline: synthetic
request_timeout_s: 60
stages:
  - stage_id: 0
    max_num_seqs: 16
    max_inflight: 64
  - stage_id: 1
    num_replicas: 1
    max_num_seqs: 1
    max_inflight: 4
    step_latency_ms: 40
    autoscale:
      min_replicas: 1
      max_replicas: 3
      target_utilization: 0.6
      scale_up_window_s: 0
      scale_down_window_s: 3
      max_scale_down_step: 1
      cooldown_s: 0.5
  - stage_id: 2
    max_num_seqs: 16
    max_inflight: 64
"""


def trickle(up: Up, seconds: float, seed: int, until: threading.Event | None = None) -> list[int]:
    """One request a second on average (each awaited) for ``seconds`` or until ``until`` is set:
    the statuses. The starts are 0.6 to 1.4 s apart (seeded): a period of exactly 1 s would
    keep each arrival at the same phase of the heartbeats (whole fractions of a second), and an
    instant's sample would see the request always or never."""
    statuses: list[int] = []
    gaps = random.Random(seed)
    t0 = next_at = time.monotonic()
    while time.monotonic() - t0 < seconds and not (until is not None and until.is_set()):
        status, body = up.generate(seed + len(statuses))
        assert status == 200, body[:300]
        statuses.append(status)
        next_at += gaps.uniform(0.6, 1.4)
        time.sleep(max(0.0, next_at - time.monotonic()))
    return statuses


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    env = {"OMNI_CP_HEARTBEAT_INTERVAL_MS": str(HEARTBEAT_MS)}
    with autoscaled_up(DEPLOY, tmp_path_factory.mktemp("trickle"), env) as up:
        yield up


def test_a_trickle_holds_the_pool_at_min_replicas(up: Up) -> None:
    wait_until(lambda: (s := up.sample(0)).ready == 1 and s.desired == 1, 30,
               interval=0.2, message=lambda: str(up.scale()))  # fmt: skip
    with Timeline(up) as timeline:
        statuses = trickle(up, TRICKLE_S, seed=1)
    logger.info("a trickle, one 40 ms request a second:\n%s", timeline.changes())
    assert len(statuses) >= TRICKLE_S - 2 and set(statuses) == {200}, statuses
    samples = timeline.samples
    assert samples[-1].t > TRICKLE_S - 2, samples[-1]
    assert {s.desired for s in samples} == {1}, timeline.changes()
    assert {s.pods for s in samples} == {1}, timeline.changes()
    # The replica reported its requests (a heartbeat that saw none would read 0 throughout),
    # and as the light load they are.
    utilizations = [s.utilization for s in samples]
    assert 0.0 < max(utilizations) < 0.6, utilizations


def test_a_real_load_scales_it_up_and_a_trickle_after_it_brings_it_back(up: Up) -> None:
    stop = threading.Event()
    statuses: list[int] = []

    def client(worker: int) -> None:  # closed loop: one request at a time per worker
        seed = 1000 + worker * 100_000
        while not stop.is_set():
            status, body = up.generate(seed)
            statuses.append(status)
            assert status == 200, body[:300]
            seed += 1

    with Timeline(up) as timeline:
        workers = [threading.Thread(target=client, args=(w,)) for w in range(4)]
        for w in workers:
            w.start()
        try:
            wait_until(
                lambda: up.sample(0).ready >= 2,
                40,
                interval=0.2,
                message=lambda: f"{timeline.changes()}\n{up.proc.stderr[-3000:]}",
            )
        finally:
            stop.set()
            for w in workers:
                w.join(60)
        # The load is gone, a trickle goes on: back to one replica, and it stays there.
        done = threading.Event()
        back: list[int] = []
        feeder = threading.Thread(target=lambda: back.extend(trickle(up, 60, 500, done)))
        feeder.start()
        try:
            wait_until(lambda: (s := up.sample(0)).desired == 1 and s.pods == 1, 40,
                       interval=0.2, message=timeline.changes)  # fmt: skip
            at_one = len(timeline.samples)
            time.sleep(5.0)  # longer than the scale-down window and the cooldown
        finally:
            done.set()
            feeder.join(60)
    logger.info("a load of 4 clients, then a trickle:\n%s", timeline.changes())
    assert statuses and set(statuses) == {200}, statuses
    assert back and set(back) == {200}, back
    assert {s.desired for s in timeline.samples[at_one:]} == {1}, timeline.changes()
