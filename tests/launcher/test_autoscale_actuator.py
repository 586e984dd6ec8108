"""``omni-up``'s autoscaling actuator against real processes: the synthetic pipeline with a
slow, autoscaled stage 1 (``min_replicas: 0``, ``max_replicas: 2``, short windows). Under a
bounded load it cannot carry alone, stage 1 gains replicas; when the load goes they are
retired by draining (exit 0, never restarted) — every request answered 200 on the way up and
down. Idle, the stage scales to zero; a request then waits (the hop client wakes the stage)
while a replica starts, and succeeds.

omni-up starts stage 1 at zero replicas (``--replicas 1:0:1``): the first request wakes it.
Its shell sets per-child ``OMNI_STAGE_*`` variables that would clash with the children's own
flags (``OMNI_STAGE_HEADLESS=1`` next to the API server's ``--api-only``): omni-up does not pass
them on, so every child, the ones the actuator starts included, comes up as omni-up says.

One omni-up serves all tests (module scope): each starts where the one before left off."""

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
hop_retries: 2
connectors:
  shm: {name: SharedMemoryConnector}
  http: {name: HttpConnector}
stages:
  - stage_id: 0
    max_num_seqs: 16
    max_inflight: 64
    output_bytes: 64
    output_connectors: {to_stage_1: shm}
  - stage_id: 1
    num_replicas: 1
    max_num_seqs: 2
    max_inflight: 2
    step_latency_ms: 150
    output_bytes: 64
    input_connectors: {from_stage_0: shm}
    output_connectors: {to_stage_2: shm}
    autoscale:
      min_replicas: 0
      max_replicas: 2
      target_utilization: 0.5
      scale_up_window_s: 0.3
      scale_down_window_s: 1.0
      max_scale_down_step: 1
      cooldown_s: 0.5
  - stage_id: 2
    max_num_seqs: 16
    max_inflight: 64
    output_bytes: 64
    input_connectors: {from_stage_1: shm}
"""


#: Variables of settings omni-up gives each child itself (see local_deploy.child_environment).
SHELL_VARIABLES = {
    "OMNI_STAGE_HEADLESS": "1",
    "OMNI_STAGE_API_ONLY": "1",
    "OMNI_STAGE_STAGE_ID": "2",
    "OMNI_STAGE_PORT": "1",
    "OMNI_STAGE_ADVERTISE_ADDRESS": "http://10.9.9.9:1",
}


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


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("autoscale")
    deploy = tmp / "deploy.yaml"
    deploy.write_text(DEPLOY)
    port, cp_port = free_port(), free_port()
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", PIPELINE,
            "--port", str(port), "--cp-port", str(cp_port), "--deploy-config", str(deploy),
            "--replicas", "1:0:1", "--drain-timeout", "10"]  # fmt: skip
    before = shm_segments()
    env = clean_env(SHELL_VARIABLES)
    proc = ManagedProcess(argv, name="omni-up", env=env, log_dir=tmp).start()
    try:
        proc.wait_for_output(READY, timeout=90)
        children = descendants(proc.pid)
        yield Up(proc, port, cp_port)
        children |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.describe()
        assert "SIGKILL" not in proc.stderr, proc.stderr
        assert [p for p in children if pid_alive(p)] == []
        assert shm_segments() - before == set()
    finally:
        proc.cleanup()


def test_a_stage_started_at_zero_is_woken_by_the_first_request(up: Up) -> None:
    assert "replicas 1:0:1" in up.proc.stdout
    assert "not passed to the children (omni-up sets these itself): " in up.proc.stderr
    assert up.stage1_pods() == set()
    status, body = up.generate(1)
    assert status == 200, body[:300]
    assert re.search(r"autoscale stage=1 starting process=.*replicas 0->1 .*wake", up.proc.stderr)


def test_a_loaded_stage_gains_replicas_and_loses_them_by_draining(up: Up) -> None:
    assert up.scale()["policy"] is not None
    statuses: list[int] = []
    stop = threading.Event()

    def client(worker: int) -> None:  # bounded: one request at a time per worker
        seed = worker * 100_000
        while not stop.is_set():
            status, body = up.generate(seed)
            statuses.append(status)
            assert status == 200, body[:300]
            seed += 1

    workers = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: len(up.stage1_pods()) >= 2, 40, interval=0.2,
                   message=lambda: f"{up.scale()}\n{up.proc.stderr[-3000:]}")  # fmt: skip
        wait_until(lambda: up.scale()["ready"] == 2, 40, interval=0.2, message=up.scale)
        time.sleep(1.0)  # traffic across both
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    # Load gone: replicas retired one at a time, each draining and exiting 0.
    wait_until(lambda: len(up.stage1_pods()) <= 1, 40, interval=0.2,
               message=lambda: f"{up.scale()}\n{up.proc.stderr[-3000:]}")  # fmt: skip
    assert statuses and set(statuses) == {200}, statuses
    retired_line = r"retired process=stage1-s1-\d+ pid=\d+ exited with code 0"
    wait_until(lambda: re.search(retired_line, up.proc.stderr), 10, interval=0.1,
               message=lambda: up.proc.stderr[-3000:])  # fmt: skip
    err = up.proc.stderr
    started = r"autoscale stage=1 starting process=stage1-s1-\d+ .*replicas [01]->2"
    assert re.search(started, err), err
    retired = re.findall(r"retired process=(stage1-s1-\d+) pid=\d+ exited with code 0", err)
    assert len(retired) >= 1, err
    # Out of discovery first (control-plane drain), SIGTERM only then.
    drained = re.findall(r"drained process=(stage1-s1-\d+) instance=\w+: SIGTERM in", err)
    assert set(retired) <= set(drained), err
    assert "restarting it" not in err and "restarted process" not in err, err


def test_an_idle_stage_scales_to_zero_and_a_request_wakes_it(up: Up) -> None:
    wait_until(lambda: not up.stage1_pods() and up.scale()["desired"] == 0, 40, interval=0.2,
               message=lambda: f"{up.scale()}\n{up.proc.stderr[-3000:]}")  # fmt: skip
    t0 = time.monotonic()
    status, body = up.generate(7)
    waited = time.monotonic() - t0
    assert status == 200, body[:300]
    assert waited > 0.2  # it waited for a replica to start
    assert len(up.stage1_pods()) >= 1
    assert re.search(r"autoscale stage=1 starting process=.*replicas 0->1 .*wake", up.proc.stderr)
    # Idle again: back to zero.
    wait_until(lambda: not up.stage1_pods(), 30, interval=0.2, message=up.scale)
