"""omni-cp on a Sentinel-managed Redis (Debian redis-server + redis-sentinel: one primary, one
replica, three sentinels on loopback): the primary is killed with -9 under registration,
heartbeat and request load; both omni-cp processes follow the failover, registrations and
heartbeats resume, and a real synthetic 1:2:1 topology with an API server fails no request."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_mesh.control_plane.redis_conn import close_redis, connect_redis
from tests.control_plane.redis_ha import SentinelGroup
from tests.procs import (
    LOCALHOST,
    ControlPlaneProcess,
    ManagedProcess,
    clean_env,
    free_port,
    start_control_plane,
    wait_until,
)
from tests.sidecar.topology import SECRET, post_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

#: Longer than a failover (down-after 1 s + election): no instance is isolated meanwhile.
LEASE_TTL_MS = 8000


def _call(method: str, url: str, body: object | None = None) -> tuple[int, dict[str, object]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except (urllib.error.URLError, OSError):
        return 0, {}


class ControlPlaneLoad:
    """One thread registering a new fake instance and heartbeating every registered one, in a
    loop, alternating between the omni-cp processes; records every status with its time."""

    def __init__(self, cps: list[ControlPlaneProcess]) -> None:
        self.cps = cps
        self.registrations: list[tuple[float, int]] = []
        self.heartbeats: list[tuple[float, int]] = []
        self._ids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            cp = self.cps[n % len(self.cps)].url
            status, body = _call(
                "POST",
                f"{cp}/v1/instances",
                {
                    "pipeline": "tiny-image",  # a pool the topology does not use
                    "stage_id": 0,
                    "address": f"http://10.99.0.{n % 250 + 1}:{1000 + n}",
                    "capacity": 4,
                },
            )
            self.registrations.append((time.monotonic(), status))
            if status == 201:
                self._ids.append(str(body["instance_id"]))
            for instance_id in self._ids[-20:]:
                status, _ = _call("PUT", f"{cp}/v1/instances/{instance_id}/heartbeat", {})
                self.heartbeats.append((time.monotonic(), status))
            time.sleep(0.02)

    def __enter__(self) -> ControlPlaneLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class Traffic:
    """Threads posting ``/v1/generate`` in a closed loop; records statuses and errors."""

    def __init__(self, url: str, workers: int = 3) -> None:
        self.url = url
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(n,), daemon=True) for n in range(workers)
        ]

    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            status, body = post_json(self.url, {"prompt": f"w{worker}-{n}"}, timeout=30)
            self.statuses.append(status)
            if status != 200:
                self.errors.append(f"{status} {body[:300].decode(errors='replace')}")
            time.sleep(0.01)

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=35)


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelGroup]:
    group = SentinelGroup().start()
    try:
        yield group
    finally:
        group.close()


def _stage(cp_urls: str, stage_id: int, log_dir: Path, *flags: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [
        sys.executable, "-m", "omni_mesh.sidecar.cli_stage",
        "--pipeline", "synthetic",
        "--stage-id", str(stage_id),
        "--control-plane", cp_urls,
        "--host", LOCALHOST,
        "--port", str(port),
        "--secret", SECRET,
        *flags,
    ]  # fmt: skip
    name = f"sentinel-s{stage_id}-{port}" if flags != ("--api-only",) else "sentinel-api"
    proc = ManagedProcess(argv, name=name, env=clean_env(), log_dir=log_dir).start()
    return proc, f"http://{LOCALHOST}:{port}"


def _instances(cp: ControlPlaneProcess, pipeline: str, stage_id: int) -> list[dict[str, object]]:
    status, body = _call("GET", f"{cp.url}/v1/pipelines/{pipeline}/stages/{stage_id}/instances")
    assert status == 200, status
    return list(body["instances"])  # type: ignore[call-overload]


async def test_client_finds_the_primary_and_closes_cleanly(sentinels: SentinelGroup) -> None:
    redis = connect_redis(sentinels.url)
    try:
        script = redis.register_script("return redis.call('INCR', KEYS[1])")
        assert await script(keys=["sentinel-k"]) >= 1
        info = await redis.info("replication")
        assert info["role"] == "master"
    finally:
        await close_redis(redis)


def _notified_within(cps: list[ControlPlaneProcess], limit_s: float) -> bool:
    watch = f"{cps[1].url}/v1/watch?pipeline=tiny-image"
    status, body = _call("GET", watch + "&timeout_s=0")
    assert status == 200, status
    seen: list[float] = []

    def long_poll() -> None:
        _call("GET", f"{watch}&since={body['version']}&timeout_s=4")
        seen.append(time.monotonic())

    thread = threading.Thread(target=long_poll, daemon=True)
    thread.start()
    time.sleep(0.3)  # the long poll is waiting
    t0 = time.monotonic()
    new = {"pipeline": "tiny-image", "stage_id": 0, "address": "http://10.98.0.1:1", "capacity": 1}
    assert _call("POST", f"{cps[0].url}/v1/instances", new)[0] == 201
    thread.join(10)
    return bool(seen) and seen[0] - t0 < limit_s


def test_failover_under_load_loses_nothing(sentinels: SentinelGroup, tmp_path: Path) -> None:
    cps = [
        start_control_plane(
            sentinels.url, lease_ttl_ms=LEASE_TTL_MS, log_dir=tmp_path, name=f"cp-sentinel-{i}"
        )
        for i in range(2)
    ]
    procs: list[ManagedProcess] = []
    try:
        assert "redis+sentinel://" in cps[0].proc.stdout
        cp_urls = ",".join(cp.url for cp in cps)
        pods = [_stage(cp_urls, s, tmp_path, "--headless") for s in (0, 1, 1, 2)]
        api, api_url = _stage(cp_urls, 0, tmp_path, "--api-only")
        procs = [p for p, _ in pods] + [api]
        for proc, url in [*pods, (api, api_url)]:
            proc.wait_http_ready(url + "/health", timeout=90)
        wait_until(lambda: len(_instances(cps[1], "synthetic", 1)) == 2, 20)

        with ControlPlaneLoad(cps) as load, Traffic(api_url + "/v1/generate") as traffic:
            wait_until(lambda: traffic.statuses.count(200) >= 20, 30, message="no traffic")
            old = sentinels.kill_primary()
            t_kill = time.monotonic()
            wait_until(
                lambda: sentinels.primary_port() not in (None, old),
                30,
                message="sentinels never promoted the replica",
            )
            # registrations and heartbeats through both omni-cp processes work again
            wait_until(
                lambda: (
                    any(t > t_kill and s == 201 for t, s in load.registrations[-5:])
                    and any(t > t_kill and s == 200 for t, s in load.heartbeats[-5:])
                ),
                30,
                message=lambda: f"registrations {load.registrations[-5:]}",
            )
            recovered_s = time.monotonic() - t_kill
            done = len(traffic.statuses)
            wait_until(lambda: len(traffic.statuses) >= done + 30, 30, message="traffic stopped")
            time.sleep(LEASE_TTL_MS / 1000 / 2)  # a lease would have expired by now if lost

        print(f"\nsentinel failover: control plane writable again {recovered_s:.2f}s after kill -9")
        assert recovered_s < 20
        assert traffic.errors == [], traffic.errors[:5]
        assert len(traffic.statuses) > 50
        # the pods' own heartbeats went on: nobody left the pools
        for cp in cps:
            for stage_id, count in ((0, 1), (1, 2), (2, 1)):
                assert len(_instances(cp, "synthetic", stage_id)) == count
        after = [s for t, s in load.registrations if t > t_kill + recovered_s]
        assert after and set(after) == {201}
        # writes during the failover are refused with a 503 (never a 500)
        statuses = {s for _, s in load.registrations + load.heartbeats}
        assert statuses <= {200, 201, 503}, statuses
        # change notifications flow again (pub/sub on the new primary): a watcher on one
        # omni-cp sees a registration through the other before its 5 s re-read
        wait_until(lambda: _notified_within(cps, 1.5), 20, interval=0.5)
    finally:
        for proc in procs:
            proc.terminate(timeout=20)
        for cp in cps:
            cp.terminate()
