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

import json
import logging
import random
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.procs import ManagedProcess, clean_env, descendants, free_port, pid_alive, wait_until
from tests.sidecar.topology import post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

logger = logging.getLogger(__name__)

READY = r"omni-up ready: http://127\.0\.0\.1:\d+"
PIPELINE = "synthetic"
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


@dataclass(frozen=True)
class Sample:
    """The stage-1 pool as the control plane and omni-up's children show it at one time."""

    t: float  # seconds since the timeline started
    desired: int
    ready: int
    utilization: float
    pods: int


class Up:
    def __init__(self, proc: ManagedProcess, port: int, cp_port: int) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.cp = f"http://127.0.0.1:{cp_port}"

    def scale(self) -> dict[str, object]:
        url = f"{self.cp}/v1/pipelines/{PIPELINE}/stages/1/scale"
        with urllib.request.urlopen(url, timeout=2) as resp:
            body: dict[str, object] = json.loads(resp.read())
        return body

    def stage1_pods(self) -> set[int]:
        """Running stage-1 sidecars among omni-up's children (draining ones included)."""
        pid = self.proc.pid
        pods = set()
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            stage1 = "--headless" in argv and argv[argv.index("--stage-id") + 1] == "1"
            if stage1 and pid_alive(int(child)):
                pods.add(int(child))
        return pods

    def generate(self, seed: int, timeout: float = 60.0) -> tuple[int, bytes]:
        return post_json(f"{self.url}/v1/generate", {"prompt": "x", "seed": seed}, timeout)

    def sample(self, t: float) -> Sample:
        body = self.scale()
        decision = body.get("decision")
        inputs = decision.get("inputs", {}) if isinstance(decision, dict) else {}
        desired = body.get("desired")
        return Sample(
            t=round(t, 2),
            desired=desired if isinstance(desired, int) else -1,
            ready=int(str(body.get("ready", 0))),
            utilization=float(inputs.get("utilization", 0.0)),
            pods=len(self.stage1_pods()),
        )


class Timeline:
    """The pool sampled every 100 ms on a thread while the block runs (``with``)."""

    def __init__(self, up: Up) -> None:
        self.up = up
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline")
        self._t0 = time.monotonic()

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.up.sample(time.monotonic() - self._t0))
            self._stop.wait(0.1)

    def changes(self) -> str:
        """The samples where desired, ready or the pod count changed (for logs and failures)."""
        out, last = [], None
        for s in self.samples:
            key = (s.desired, s.ready, s.pods)
            if key != last:
                out.append(f"t={s.t:.1f}s desired={s.desired} ready={s.ready} pods={s.pods} "
                           f"utilization={s.utilization:.2f}")  # fmt: skip
                last = key
        utilizations = [s.utilization for s in self.samples]
        busy = sum(u > 0 for u in utilizations)
        out.append(f"utilization: max {max(utilizations, default=0.0):.2f}, above 0 in {busy} "
                   f"of {len(utilizations)} samples")  # fmt: skip
        return "\n".join(out)


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
    tmp = tmp_path_factory.mktemp("trickle")
    deploy = tmp / "deploy.yaml"
    deploy.write_text(DEPLOY)
    port, cp_port = free_port(), free_port()
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", PIPELINE,
            "--port", str(port), "--cp-port", str(cp_port), "--deploy-config", str(deploy),
            "--drain-timeout", "10"]  # fmt: skip
    before = shm_segments()
    env = clean_env({"OMNI_CP_HEARTBEAT_INTERVAL_MS": str(HEARTBEAT_MS)})
    proc = ManagedProcess(argv, name="omni-up", env=env, log_dir=tmp).start()
    try:
        proc.wait_for_output(READY, timeout=90)
        children = descendants(proc.pid)
        yield Up(proc, port, cp_port)
        children |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.describe()
        assert [p for p in children if pid_alive(p)] == []
        assert shm_segments() - before == set()
    finally:
        proc.cleanup()


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
