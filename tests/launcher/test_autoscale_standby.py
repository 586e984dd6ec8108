"""Warm standby replicas through ``omni-up`` (real processes): stage 1 of the synthetic pipeline
autoscales from zero with ``standby_replicas: 1``. omni-up keeps one stage-1 replica started,
loaded and registered as *standby* (listed by the control plane, counted apart, never routed
to). A request to the stage at zero is served by promoting that standby (no replica has to
start first), omni-up starts a new standby in the background, and when the load is gone the
promoted replica is drained while a standby stays warm."""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import ManagedProcess, clean_env, descendants, free_port, pid_alive, wait_until
from tests.sidecar.topology import post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

READY = r"omni-up ready: http://127\.0\.0\.1:\d+"
PIPELINE = "synthetic"

DEPLOY = """\
pipeline: synthetic
request_timeout_s: 60
stages:
  - stage_id: 0
    max_num_seqs: 16
    max_inflight: 64
  - stage_id: 1
    num_replicas: 0
    max_num_seqs: 2
    max_inflight: 2
    step_latency_ms: 20
    autoscale:
      min_replicas: 0
      max_replicas: 2
      standby_replicas: 1
      target_utilization: 0.5
      scale_up_window_s: 0.3
      scale_down_window_s: 1.0
      cooldown_s: 0.5
  - stage_id: 2
    max_num_seqs: 16
    max_inflight: 64
"""


class Up:
    def __init__(self, proc: ManagedProcess, port: int, cp_port: int) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.cp = f"http://127.0.0.1:{cp_port}"

    def _get(self, path: str) -> dict[str, object]:
        with urllib.request.urlopen(self.cp + path, timeout=2) as resp:
            body: dict[str, object] = json.loads(resp.read())
        return body

    def states(self) -> dict[str, str]:
        """Stage 1's instances (any state) by id, as the control plane lists them."""
        body = self._get(f"/v1/pipelines/{PIPELINE}/stages/1/instances?all=1")
        instances = body["instances"]
        assert isinstance(instances, list)
        return {i["instance_id"]: i["state"] for i in instances}

    def scale(self) -> dict[str, object]:
        return self._get(f"/v1/pipelines/{PIPELINE}/stages/1/scale")

    def cp_metric(self, line_start: str) -> float | None:
        with urllib.request.urlopen(self.cp + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return None

    def stage1_pods(self) -> set[int]:
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


def standby_only(up: Up) -> bool:
    states = up.states()
    return list(states.values()) == ["standby"]


def seen(up: Up) -> str:
    return f"{up.scale()}\n{up.states()}\n{up.proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("standby")
    deploy = tmp / "deploy.yaml"
    deploy.write_text(DEPLOY)
    port, cp_port = free_port(), free_port()
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", PIPELINE,
            "--port", str(port), "--cp-port", str(cp_port), "--deploy-config", str(deploy),
            "--drain-timeout", "10"]  # fmt: skip
    before = shm_segments()
    proc = ManagedProcess(argv, name="omni-up", env=clean_env(), log_dir=tmp).start()
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


def test_a_stage_at_zero_keeps_one_warm_standby_out_of_its_pool(up: Up) -> None:
    wait_until(lambda: standby_only(up), 60, interval=0.2,
               message=lambda: f"{up.states()}\n{up.proc.stderr[-3000:]}")  # fmt: skip
    assert up.scale()["desired"] == 0
    assert re.search(r"autoscale stage=1 starting standby process=stage1-s1-\d+", up.proc.stderr)
    stage = f'pipeline="{PIPELINE}",stage="1"'
    wait_until(lambda: up.cp_metric(f'omni_cp_instances{{{stage},state="standby"}}') == 1.0, 10)
    assert up.cp_metric(f'omni_cp_instances{{{stage},state="healthy"}}') == 0.0
    time.sleep(1.0)
    assert standby_only(up)  # not promoted while nothing asks for the stage


def test_a_request_is_served_by_promoting_the_standby(up: Up) -> None:
    wait_until(lambda: standby_only(up), 60, interval=0.2, message=up.states)
    [standby] = up.states()
    t0 = time.monotonic()
    status, body = post_json(f"{up.url}/v1/generate", {"prompt": "x", "seed": 3}, 60)
    waited = time.monotonic() - t0
    assert status == 200, body[:300]
    # The standby that was waiting serves: no replica had to start for this request.
    assert up.states()[standby] == "healthy"
    assert waited < 10.0, waited  # generous; a cold start is what the standby saves
    promotions = f'omni_cp_standby_promotions_total{{pipeline="{PIPELINE}",stage="1"}}'
    assert (up.cp_metric(promotions) or 0.0) >= 1.0
    # omni-up replaces the promoted standby in the background (a light load keeps the stage
    # at one serving replica meanwhile).
    stop = threading.Event()
    statuses: list[int] = []

    def light_load() -> None:
        seed = 1000
        while not stop.is_set():
            statuses.append(
                post_json(f"{up.url}/v1/generate", {"prompt": "x", "seed": seed}, 60)[0]
            )
            seed += 1

    loader = threading.Thread(target=light_load)
    loader.start()
    try:
        wait_until(lambda: sorted(up.states().values()) == ["healthy", "standby"], 60,
                   interval=0.2, message=lambda: seen(up))  # fmt: skip
        assert len(up.stage1_pods()) == 2
    finally:
        stop.set()
        loader.join(60)
    assert statuses and set(statuses) == {200}, statuses


def test_idle_again_the_promoted_replica_leaves_and_a_standby_stays(up: Up) -> None:
    # The module's omni-up, after the test before promoted a standby (a fresh one has promoted
    # nothing, and nothing would have to leave: the module is one unit under pytest-xdist).
    promotions = f'omni_cp_standby_promotions_total{{pipeline="{PIPELINE}",stage="1"}}'
    assert (up.cp_metric(promotions) or 0.0) >= 1.0, "no standby was promoted before"
    wait_until(lambda: up.scale()["desired"] == 0 and standby_only(up), 60, interval=0.2,
               message=lambda: seen(up))  # fmt: skip
    wait_until(lambda: len(up.stage1_pods()) == 1, 30, interval=0.2,
               message=lambda: up.proc.stderr[-3000:])  # fmt: skip
    err = up.proc.stderr
    assert re.search(r"drained process=stage1-s1-\d+ instance=\w+: SIGTERM in", err), err
    assert "restarting it" not in err and "restarted process" not in err, err
