"""``autoscale: target_first_audio_p95_ms`` and ``target_realtime_factor_p5`` through ``omni-up``
with real processes (issue 35, item 3): tiny-tts (talker -> code2wav, ``async_chunk: true`` so
speech streams, 10 frames a chunk) whose talker runs and admits one request at a time
(``max_num_seqs: 1``, ``max_inflight: 1``), so streamed speech requests from several clients
wait for it: their first audio grows and their real-time factor falls with the clients. Short
answers (two chunks) keep the answers many enough in the API server's 10 s window for a
quantile (at least 20). The talker's utilization cannot pass 1.0 and its
``target_utilization: 1.0`` never asks for more; its queue wait is not targeted.
The API server measures every answer's first audio and real-time factor and its heartbeats
carry the last seconds' windows (``first_audio_le_<s>``, ``rtf_le_<x>``); the autoscaler merges
the API servers' windows, and a first-audio p95 past its target (a real-time factor p5 below
its floor) adds a talker replica (reason ``first_audio``, ``realtime_factor``). With the load
gone the talker is idle and the pool drains back to one replica."""

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
#: Alone an answer's 1.6 s of audio is made in about 0.15 s (10x real time); behind 3 others,
#: in about 0.5 s.
RTF_FLOOR = 5.0
TARGETS = {
    "first_audio": f"target_first_audio_p95_ms: {TARGET_MS}",
    "realtime_factor": f"target_realtime_factor_p5: {RTF_FLOOR}",
}
CLIENTS = 4
TEXT = "say it now"  # 10 bytes: 20 talker frames, two chunks

DEPLOY = """\
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
      {target}
      scale_up_window_s: 0.5
      scale_down_window_s: 4
      cooldown_s: 0.5
  - stage_id: 1
    max_num_seqs: 16
    max_inflight: 128
"""


@pytest.fixture(scope="module", params=sorted(TARGETS))
def up_and_target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Up, str]]:
    """omni-up of the deployment with one of the targets, and which (the reason expected)."""
    env = {"OMNI_CP_HEARTBEAT_INTERVAL_MS": "250"}
    tmp = tmp_path_factory.mktemp(request.param)
    deploy = DEPLOY.format(target=TARGETS[request.param])
    with autoscaled_up(deploy, tmp, env, pipeline="tiny-tts", stage=0) as up:
        yield up, request.param


def speech(up: Up, seed: int) -> tuple[int, bytes, float]:
    """A streamed speech answer (PCM streams): status, body, seconds to the whole answer."""
    body = {"model": "tiny-tts", "input": TEXT, "voice": "echo", "response_format": "pcm",
            "seed": seed}  # fmt: skip
    t0 = time.monotonic()
    status, data = post_json(f"{up.url}/v1/audio/speech", body, timeout=60)
    return status, data, time.monotonic() - t0


def test_an_audio_slo_missed_adds_a_talker_and_the_pool_drains_back(
    up_and_target: tuple[Up, str],
) -> None:
    up, target = up_and_target
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
    # The SLO asked for the talker: the first decision for 2 names it, with the figure past
    # the target, while the utilization alone never could.
    first = next(s for s in during if s.desired == 2)
    assert first.reason == target, timeline.changes()
    if first.reason == "first_audio":
        assert first.first_audio_p95_ms is not None and first.first_audio_p95_ms > TARGET_MS
    else:
        assert first.realtime_factor_p5 is not None and first.realtime_factor_p5 < RTF_FLOOR
    assert max(s.utilization for s in during) <= 1.0 + 1e-9, timeline.changes()
    # Drained back with the load gone (the talker idle), to the minimum.
    final = up.sample()  # the timeline's last sample may precede what the wait saw
    assert final.desired == 1 and final.pods == 1, final


def test_a_bad_first_audio_target_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(DEPLOY.format(target="target_first_audio_p95_ms: 0"))
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", "tiny-tts",
            "--deploy-config", str(path)]  # fmt: skip
    done = subprocess.run(argv, env=clean_env(None), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "autoscale.target_first_audio_p95_ms" in done.stderr, done.stderr
    assert "greater than 0" in done.stderr, done.stderr
