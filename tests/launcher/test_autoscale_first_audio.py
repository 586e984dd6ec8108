"""An ``autoscale: target_first_audio_p95_ms`` through ``omni-up`` with real processes (issue 35,
item 3): tiny-tts (talker -> code2wav, ``async_chunk: true`` so speech streams, 10 frames a
chunk) whose talker runs and admits one request at a time (``max_num_seqs: 1``,
``max_inflight: 1``), so streamed speech requests from several clients wait for it and their
first audio grows with the clients. Short answers (two chunks) keep the answers many enough in
the API server's 10 s window for a p95 (at least 20). The talker's utilization cannot pass
1.0 and its ``target_utilization: 1.0`` never asks for more; its queue wait is not targeted.
The API server measures every answer's first audio and its heartbeats carry the last seconds'
window (``first_audio_le_<s>``); the autoscaler merges the API servers' windows, and a p95
past the target adds a talker replica (reason ``first_audio``). With the load gone the talker
is idle and the pool drains back to one replica."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launcher.autoscaled import Timeline, Up, autoscaled_up
from tests.procs import clean_env, wait_until
from tests.sidecar.topology import post_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

logger = logging.getLogger(__name__)

TARGET_MS = 150.0
CLIENTS = 4
TEXT = "say it now"  # 10 bytes: 20 talker frames, two chunks

DEPLOY = f"""\
pipeline: tiny-tts
request_timeout_s: 60
async_chunk: true
stages:
  - stage_id: 0
    num_replicas: 1
    max_num_seqs: 1
    max_inflight: 1
    autoscale:
      min_replicas: 1
      max_replicas: 2
      target_utilization: 1.0
      target_first_audio_p95_ms: {TARGET_MS}
      scale_up_window_s: 0.5
      scale_down_window_s: 4
      cooldown_s: 0.5
  - stage_id: 1
    max_num_seqs: 16
    max_inflight: 128
"""


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    env = {"OMNI_CP_HEARTBEAT_INTERVAL_MS": "250"}
    tmp = tmp_path_factory.mktemp("first_audio")
    with autoscaled_up(DEPLOY, tmp, env, pipeline="tiny-tts", stage=0) as up:
        yield up


def speech(up: Up, seed: int) -> tuple[int, bytes, float]:
    """A streamed speech answer (PCM streams): status, body, seconds to the whole answer."""
    body = {"model": "tiny-tts", "input": TEXT, "voice": "echo", "response_format": "pcm",
            "seed": seed}  # fmt: skip
    t0 = time.monotonic()
    status, data = post_json(f"{up.url}/v1/audio/speech", body, timeout=60)
    return status, data, time.monotonic() - t0


def test_a_first_audio_p95_past_its_target_adds_a_talker_and_the_pool_drains_back(
    up: Up,
) -> None:
    wait_until(lambda: (s := up.sample()).ready == 1 and s.desired == 1, 30,
               interval=0.2, message=lambda: str(up.scale()))  # fmt: skip
    status, body, alone = speech(up, 0)
    assert status == 200 and len(body) > 0, body[:300]
    stop = threading.Event()
    statuses: list[int] = []
    took: list[float] = []

    def client(worker: int) -> None:  # closed loop: one request at a time per worker
        seed = worker * 100_000
        while not stop.is_set():
            status, body, seconds = speech(up, seed)
            statuses.append(status)
            took.append(seconds)
            assert status == 200, body[:300]
            seed += 1

    with Timeline(up) as timeline:
        workers = [threading.Thread(target=client, args=(w,)) for w in range(CLIENTS)]
        for w in workers:
            w.start()
        try:
            wait_until(lambda: up.sample().ready == 2, 60, interval=0.2,
                       message=timeline.changes)  # fmt: skip
        finally:
            stop.set()
            for w in workers:
                w.join(60)
        loaded = len(timeline.samples)
        wait_until(lambda: (s := up.sample()).desired == 1 and s.pods == 1, 40,
                   interval=0.2, message=timeline.changes)  # fmt: skip
    took.sort()
    logger.info(
        "one answer alone %.0f ms; %d clients: %d answers, median %.0f ms; then none:\n%s",
        alone * 1000, CLIENTS, len(took), took[len(took) // 2] * 1000 if took else 0.0,
        timeline.changes(),
    )  # fmt: skip
    assert statuses and set(statuses) == {200}, statuses
    during = timeline.samples[:loaded]
    # The first audio asked for the talker: the first decision for 2 names it, with the p95
    # past the target, while the utilization alone never could.
    first = next(s for s in during if s.desired == 2)
    assert first.reason == "first_audio", timeline.changes()
    assert first.first_audio_p95_ms is not None and first.first_audio_p95_ms > TARGET_MS, first
    assert max(s.utilization for s in during) <= 1.0 + 1e-9, timeline.changes()
    # Drained back with the load gone (the talker idle), to the minimum.
    assert timeline.samples[-1].desired == 1 and timeline.samples[-1].pods == 1


def test_a_bad_first_audio_target_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(DEPLOY.replace(f"target_first_audio_p95_ms: {TARGET_MS}",
                                   "target_first_audio_p95_ms: 0"))  # fmt: skip
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", "tiny-tts",
            "--deploy-config", str(path)]  # fmt: skip
    done = subprocess.run(argv, env=clean_env(None), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "autoscale.target_first_audio_p95_ms" in done.stderr, done.stderr
    assert "greater than 0" in done.stderr, done.stderr
