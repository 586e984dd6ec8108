"""``omni-up``'s lifecycle against real processes: a replica killed with -9 is restarted on its
port while the rest keeps serving; Ctrl-C under load then drains the deployment in pipeline
order (every request answered, nothing SIGKILLed, no shared memory left); a stage that cannot
start makes omni-up stop everything and exit 1, naming it.

An API server (``--api-only``) counts no requests in flight, so its drain is aiohttp's graceful
shutdown: the requests it is handling finish, but one whose bytes are still unread in its socket
is reset. The Ctrl-C test therefore signals once every request has reached stage 0."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from omni_mesh.launcher import cli as cli_up
from omni_mesh.launcher import local_deploy
from tests import media_readers
from tests.procs import (
    ManagedProcess,
    clean_env,
    descendants,
    free_port,
    http_status,
    pid_alive,
    wait_until,
)
from tests.sidecar.topology import post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

READY = r"omni-up ready: http://127\.0\.0\.1:\d+"


def _omni_up(tmp_path: Path, port: int, *args: str) -> ManagedProcess:
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", "tiny-tts",
            "--port", str(port), *args]  # fmt: skip
    return ManagedProcess(argv, name="omni-up", env=clean_env(), log_dir=tmp_path).start()


def _stage_pods(up: ManagedProcess, stage_id: int) -> dict[int, int]:
    """Sidecar pid → port of each running replica of ``stage_id`` (omni-up's own children)."""
    pods = {}
    for pid in Path(f"/proc/{up.pid}/task/{up.pid}/children").read_text().split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if (
            "omni_mesh.sidecar.cli_stage" in argv
            and "--headless" in argv
            and argv[argv.index("--stage-id") + 1] == str(stage_id)
            and pid_alive(int(pid))
        ):
            pods[int(pid)] = int(argv[argv.index("--port") + 1])
    return pods


def _hops_seen(stage_port: int) -> float:
    """Hops a stage pod has in flight plus those it has answered (from its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stage_port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("omni_stage_in_flight{") or (
            line.startswith("omni_stage_requests_total{") and 'route="hop"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _speech(port: int, text: str) -> tuple[int, bytes]:
    return post_json(
        f"http://127.0.0.1:{port}/v1/audio/speech",
        {"model": "tiny-tts", "input": text, "voice": "echo"},
    )


def _kill_9_and_wait_for_the_restart(up: ManagedProcess, port: int) -> None:
    """Kill one stage-1 replica with -9: the other keeps serving, omni-up restarts it on its
    port, and it serves again."""
    pods = _stage_pods(up, 1)
    assert len(pods) == 2, pods
    victim, victim_port = next(iter(pods.items()))
    health = f"http://127.0.0.1:{victim_port}/health"
    assert http_status(health) == 200

    os.kill(victim, signal.SIGKILL)
    # The other replica takes the work meanwhile (a hop to the dead one is replayed).
    status, body = _speech(port, "while one replica is down")
    assert status == 200 and media_readers.read_wav(body)[1] == 24000

    def back() -> bool:
        now = _stage_pods(up, 1)
        return victim not in now and victim_port in now.values() and http_status(health) == 200

    wait_until(back, 20, interval=0.2, message=lambda: up.describe())
    assert up.alive
    restart = rf"process=stage1-code2wav-\d+ pid={victim} was killed by SIGKILL; restarting"
    assert re.search(restart, up.stderr), up.stderr
    again = r"process=stage1-code2wav-\d+ pid=\d+ is ready again"
    wait_until(lambda: re.search(again, up.stderr), 5, message=lambda: up.stderr)
    for i in range(3):
        status, body = _speech(port, f"after the restart {i}")
        assert status == 200 and media_readers.read_wav(body)[1] == 24000


def _ctrl_c_under_load(up: ManagedProcess, port: int) -> None:
    """Ctrl-C with 8 requests in flight: every one answered (200, or 503 once draining), the
    processes stopped in pipeline order, none SIGKILLed."""
    results: dict[int, object] = {}
    sent = [threading.Event() for _ in range(8)]

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            body = {"model": "tiny-tts", "input": f"request {i} " * 4, "voice": "echo"}
            conn.request("POST", "/v1/audio/speech", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            sent[i].set()
            response = conn.getresponse()
            results[i] = (response.status, response.read())
        except (OSError, http.client.HTTPException) as exc:
            results[i] = exc
        finally:
            sent[i].set()
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(sent))]
    for t in threads:
        t.start()
    assert all(e.wait(10) for e in sent)
    # Once every request has reached stage 0, the API server holds each one (a request
    # still unread in its socket when it stops would be reset: see the module docstring).
    (stage0_port,) = _stage_pods(up, 0).values()
    wait_until(lambda: _hops_seen(stage0_port) >= len(sent), 10, interval=0.02)
    mark = len(up.stderr)
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=60) == 0, up.describe()
    for t in threads:
        t.join(10)

    statuses = []
    for i in range(len(sent)):
        result = results.get(i)
        assert isinstance(result, tuple), f"request {i}: {result!r} (dropped)"
        status, body = result
        assert status in (200, 503), (status, body[:300])
        if status == 200:
            assert media_readers.read_wav(body)[1] == 24000
        statuses.append(status)
    assert statuses.count(200) >= 1, statuses
    stop_log = up.stderr[mark:]
    # Pipeline order, each group after the one before: API server, stage 0, stage 1, cp.
    order = re.findall(r"stopping process=(\S+)", stop_log)
    assert order[0] == "api-server" and order[-1] == "control-plane", order
    assert order[1].startswith("stage0-") and {o[:7] for o in order[2:4]} == {"stage1-"}
    assert "SIGKILL" not in stop_log, stop_log


@pytest.mark.timeout(240)  # two scenarios' worth
def test_a_replica_killed_with_minus_9_is_restarted_then_ctrl_c_drains_in_pipeline_order(
    tmp_path: Path,
) -> None:
    """One deployment (its start-up is most of the cost) for two scenarios, in this order: a
    replica killed with -9 comes back on its port; then Ctrl-C under load drains everything,
    the restarted replica included, leaving no process and no shared memory. (This is also
    ``omni-up``'s Ctrl-C end to end; its SIGTERM twin is in tests/run_client/test_clis_e2e.py.)"""
    before = shm_segments()
    port = free_port()
    up = _omni_up(tmp_path, port, "--replicas", "1:2")
    try:
        up.wait_for_output(READY, timeout=90)
        assert re.search(r"control plane\s+http://", up.stdout), up.stdout
        children = descendants(up.pid)
        assert len(children) >= 5  # omni-cp (+ redis), 3 pods (+ engines), API server
        _kill_9_and_wait_for_the_restart(up, port)
        children |= descendants(up.pid)
        _ctrl_c_under_load(up, port)
        assert [p for p in children if pid_alive(p)] == []
        assert shm_segments() - before == set()
    finally:
        up.cleanup()


def test_a_stage_that_can_never_start_makes_omni_up_exit_1_naming_it(tmp_path: Path) -> None:
    port = free_port()
    # Valid for the deploy schema, refused by the talker engine when it starts.
    up = _omni_up(tmp_path, port, "--replicas", "1:1", "--stage-overrides",
                  '{"0": {"engine_extras": {"max_frames": 0}}}')  # fmt: skip
    try:
        assert up.wait(timeout=90) == 1, up.describe()
        err = up.stderr
        assert "omni-up: process 'stage0-talker-0'" in err, err
        assert "before it was ever ready" in err and "engine_extras.max_frames" in err, err
        assert "restarted process" not in err
        assert "logs kept in" in err
        assert "omni-up ready" not in up.stdout
        log_dir = re.search(r"logs kept in (\S+)", err)
        assert log_dir is not None
        for log in Path(log_dir.group(1)).iterdir():
            log.unlink()
        Path(log_dir.group(1)).rmdir()
    finally:
        up.cleanup()


def test_stop_timeout_covers_the_drain_and_plans_stop_in_pipeline_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = cli_up.parse_args(["--pipeline", "tiny-omni", "--replicas", "1:2:1"], {})
    assert (config.drain_timeout_s, config.stop_timeout_s) == (30.0, 40.0)
    config = cli_up.parse_args(["--pipeline", "tiny-tts", "--drain-timeout", "5"], {})
    assert (config.drain_timeout_s, config.stop_timeout_s) == (5.0, 15.0)
    with pytest.raises(SystemExit) as exit_:
        cli_up.parse_args(["--pipeline", "tiny-tts", "--stop-timeout", "3"], {})
    assert exit_.value.code == 2
    assert "--stop-timeout (3) must be at least --drain-timeout (30)" in capsys.readouterr().err

    config = cli_up.parse_args(["--pipeline", "tiny-omni", "--replicas", "1:2:1"], {})
    plans = local_deploy.plan_stages(config, "http://127.0.0.1:7700")
    assert all(p.argv[p.argv.index("--drain-timeout") + 1] == "30" for p in plans)
    ranks = {p.name: p.stop_rank for p in plans}
    assert ranks == {"stage0-thinker-0": 1, "stage1-talker-0": 2, "stage1-talker-1": 2,
                     "stage2-code2wav-0": 3, "api-server": 0}  # fmt: skip
    assert local_deploy.plan_control_plane(7700, stop_rank=4).stop_rank == 4
