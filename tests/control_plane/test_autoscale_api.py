"""The stage scale resource against real processes: two omni-cp on one real Redis, instances
that heartbeat load over real HTTP. Only the sweeper-lock holder decides; both serve the same
decision; load raises the desired count and idleness lowers it (to zero, and a waiting request
wakes it); ``omni-cp status`` shows DESIRED; the gauges and the decision counter are exposed."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    ControlPlaneRequestError,
    LoadReport,
    RegisterRequest,
    ScaleDirection,
)
from tests.control_plane.scaling import heartbeating, until
from tests.procs import (
    ControlPlaneProcess,
    RedisServer,
    clean_env,
    cp_argv,
    start_control_plane,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PIPELINE = "synthetic"
FAST = AutoscaleConfig(
    min_replicas=1,
    max_replicas=4,
    target_utilization=0.5,
    scale_up_window_s=0.3,
    scale_down_window_s=0.6,
    cooldown_s=0.0,
    max_scale_down_step=4,
)


@pytest.fixture(scope="module")
def two_cps(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ControlPlaneProcess, ControlPlaneProcess]]:
    """Two omni-cp (sweep every 100 ms) on the session Redis, emptied first. Leases and the
    sweeper lock last 10 s: on a loaded machine (2 cores, vLLM engines of other runs) a test
    process or an omni-cp can stall for more than a second, and with 1 s the instances'
    leases expired (ready=0) or the lock changed hands (the other omni-cp decided). Nothing
    here waits on an expiry: the last test stops the holder cleanly, which frees the lock."""
    if redis_server.proc is None or not redis_server.proc.alive:
        redis_server.start()
    redis_server.flushall()
    started: list[ControlPlaneProcess] = []
    try:
        for name in ("omni-cp-scale-a", "omni-cp-scale-b"):
            started.append(
                start_control_plane(
                    redis_server.url,
                    heartbeat_interval_ms=200,
                    lease_ttl_ms=10_000,
                    sweep_interval_ms=100,
                    extra_args=["--sweeper-lock-ttl-ms", "10000"],
                    log_dir=tmp_path_factory.mktemp(name),
                    name=name,
                )
            )
        yield started[0], started[1]
    finally:
        for cp in started:
            cp.proc.cleanup()


@pytest.fixture
async def clients(
    two_cps: tuple[ControlPlaneProcess, ControlPlaneProcess],
) -> AsyncIterator[tuple[ControlPlaneClient, ControlPlaneClient]]:
    a = ControlPlaneClient([two_cps[0].url], timeout_s=5.0)
    b = ControlPlaneClient([two_cps[1].url], timeout_s=5.0)
    yield a, b
    await a.close()
    await b.close()


@pytest.fixture(autouse=True)
async def _no_policy_left(
    two_cps: tuple[ControlPlaneProcess, ControlPlaneProcess],
) -> AsyncIterator[None]:
    """A test that fails half-way leaves no policy behind for the next (one failure used to
    turn ``test_bad_requests_name_the_field``'s DELETE 404 into a 204)."""
    yield
    cp = next((cp for cp in two_cps if cp.proc.alive), None)
    if cp is None:
        return
    client = ControlPlaneClient([cp.url], timeout_s=5.0)
    try:
        for stage_id in range(3):
            with contextlib.suppress(ControlPlaneRequestError):
                await client.remove_scale_policy(PIPELINE, stage_id)
    finally:
        await client.close()


def metrics_text(cp: ControlPlaneProcess) -> str:
    with urllib.request.urlopen(f"{cp.url}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels}`` (labels in any order) in an exposition."""
    for match in re.finditer(rf"^{name}(?:\{{(.*)\}})? (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")) == labels:
            return float(match.group(2))
    return None


def leader_of(
    cps: tuple[ControlPlaneProcess, ControlPlaneProcess],
) -> tuple[ControlPlaneProcess, ControlPlaneProcess]:
    """(lock holder, the other one)."""
    a, b = cps
    return (a, b) if metric(metrics_text(a), "omni_cp_sweeper_leader") == 1.0 else (b, a)


@contextlib.asynccontextmanager
async def replicas(
    client: ControlPlaneClient, stage_id: int, load: dict[str, int], count: int, port0: int
) -> AsyncIterator[list[str]]:
    """``count`` registered instances heartbeating ``load["in_flight"]`` of capacity 10 every
    200 ms until the block ends (then they leave)."""
    ids = []
    for k in range(count):
        reg = await client.register(
            RegisterRequest(
                pipeline=PIPELINE,
                stage_id=stage_id,
                address=f"http://127.0.0.1:{port0 + k}",
                capacity=10,
            )
        )
        ids.append(reg.instance_id)

    def reports() -> dict[str, LoadReport]:
        return {i: LoadReport(in_flight=load["in_flight"], capacity=10) for i in ids}

    async with heartbeating(client, reports):
        yield ids


async def test_load_raises_idle_lowers_and_both_serve_one_decision(
    two_cps: tuple[ControlPlaneProcess, ControlPlaneProcess],
    clients: tuple[ControlPlaneClient, ControlPlaneClient],
) -> None:
    a, b = clients
    leader, follower = leader_of(two_cps)
    load = {"in_flight": 5}  # utilization 0.5 = the target
    async with replicas(a, 1, load, count=2, port0=9710):
        status = await a.set_scale_policy(PIPELINE, 1, FAST)
        assert status.policy == FAST and status.desired == 2 and status.ready == 2
        assert status.decision is not None and status.decision.reason == "initial"
        held = await until(
            lambda: b.scale(PIPELINE, 1),
            lambda s: s.decision is not None and s.decision.reason != "initial",
        )
        assert held.desired == 2

        load["in_flight"] = 10  # utilization 1.0, twice the target: 4 replicas
        up = await until(lambda: b.scale(PIPELINE, 1), lambda s: s.desired == 4)
        assert up.decision is not None and up.decision.inputs.ready == 2
        assert up.decision.inputs.utilization == pytest.approx(1.0)
        seen_by_a = await a.scale(PIPELINE, 1)
        assert seen_by_a.desired == 4 and seen_by_a.decision is not None
        assert seen_by_a.decision.decided_at_ms >= up.decision.decided_at_ms

        load["in_flight"] = 0
        down = await until(lambda: a.scale(PIPELINE, 1), lambda s: s.desired == 1)
        assert down.decision is not None and down.decision.reason == "idle"

    # Only the lock holder decided: its log has the decisions, the other's has none.
    await asyncio.sleep(0.2)
    assert re.search(r"autoscale up pipeline=synthetic stage=1 desired=2->4", leader.proc.stderr)
    assert "autoscale down pipeline=synthetic stage=1" in leader.proc.stderr
    assert not re.search(r"autoscale (up|down|hold) ", follower.proc.stderr)
    text = metrics_text(leader)
    labels = {"pipeline": PIPELINE, "stage": "1"}
    assert metric(text, "omni_cp_scale_decisions_total", **labels, direction="up",
                  reason="utilization") == 1.0  # fmt: skip
    assert metric(metrics_text(follower), "omni_cp_scale_decisions_total", **labels,
                  direction="up", reason="utilization") is None  # fmt: skip
    # Every omni-cp serves the gauges from Redis.
    for cp in two_cps:
        text = metrics_text(cp)
        assert metric(text, "omni_cp_desired_replicas", **labels) == 1.0
        assert metric(text, "omni_cp_stage_utilization", **labels) is not None
        assert metric(text, "omni_cp_recommended_replicas", **labels) is not None
    await a.remove_scale_policy(PIPELINE, 1)
    assert (await b.scale(PIPELINE, 1)).policy is None


async def test_scale_to_zero_status_and_wake(
    two_cps: tuple[ControlPlaneProcess, ControlPlaneProcess],
    clients: tuple[ControlPlaneClient, ControlPlaneClient],
) -> None:
    a, b = clients
    to_zero = FAST.model_copy(update={"min_replicas": 0})
    status = await a.set_scale_policy(PIPELINE, 2, to_zero, replicas=1)
    assert status.desired == 1 and status.ready == 0
    zero = await until(lambda: b.scale(PIPELINE, 2), lambda s: s.desired == 0)
    assert zero.decision is not None and zero.decision.reason == "idle"

    result = await asyncio.to_thread(
        subprocess.run,
        cp_argv("status", "--cp", two_cps[1].url, "--pipeline", PIPELINE),
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].split()[-1] == "DESIRED"
    # a stage at zero: no instance, so every instance column (ROLE included) is "-"
    assert lines[1].split() == [
        PIPELINE, "2", "-", "-", "-", "-", "-", "-", "-", "no_replicas", "0"
    ]  # fmt: skip

    woken = await b.wake_stage(PIPELINE, 2, waiting=1)
    assert woken.policy is not None
    up = await until(lambda: a.scale(PIPELINE, 2), lambda s: s.desired == 1, within_s=10.0)
    assert up.decision is not None
    assert (up.decision.direction, up.decision.reason) == (ScaleDirection.UP, "wake")
    await a.remove_scale_policy(PIPELINE, 2)


async def test_policy_survives_a_repeated_put_and_a_changed_bound(
    clients: tuple[ControlPlaneClient, ControlPlaneClient],
) -> None:
    a, b = clients
    load = {"in_flight": 5}
    async with replicas(a, 0, load, count=3, port0=9720):
        first = await a.set_scale_policy(PIPELINE, 0, FAST, replicas=3)
        assert first.desired == 3
        again = await b.set_scale_policy(PIPELINE, 0, FAST, replicas=1)  # launcher restart
        assert again.desired == 3, "a repeated PUT keeps the current decision"
        narrow = FAST.model_copy(update={"max_replicas": 2})
        await b.set_scale_policy(PIPELINE, 0, narrow)
        bounded = await until(lambda: a.scale(PIPELINE, 0), lambda s: s.desired == 2)
        assert bounded.policy == narrow
        assert bounded.decision is not None and bounded.decision.reason == "bounds"
    await a.remove_scale_policy(PIPELINE, 0)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "field"),
    [
        ("PUT", "/synthetic/stages/1/scale", {"autoscale": {"target_utilization": 2}}, 400,
         "autoscale.target_utilization"),
        ("PUT", "/synthetic/stages/1/scale",
         {"autoscale": {"min_replicas": 3, "max_replicas": 2}}, 400, "autoscale"),
        ("PUT", "/synthetic/stages/1/scale", {"autoscale": {}, "replicas": -1}, 400, "replicas"),
        ("PUT", "/synthetic/stages/1/scale", {"policy": {}}, 400, "autoscale"),
        ("PUT", "/synthetic/stages/1/scale", None, 400, "body"),
        ("PUT", "/nope/stages/1/scale", {"autoscale": {}}, 400, "pipeline"),
        ("GET", "/synthetic/stages/9/scale", None, 400, "stage_id"),
        ("GET", "/synthetic/stages/x/scale", None, 400, "stage_id"),
        ("DELETE", "/synthetic/stages/1/scale", None, 404, "stage_id"),
        ("POST", "/synthetic/stages/1/scale/wake", None, 404, "stage_id"),
    ],
)  # fmt: skip
async def test_bad_requests_name_the_field(
    two_cps: tuple[ControlPlaneProcess, ControlPlaneProcess],
    method: str,
    path: str,
    body: object,
    status: int,
    field: str,
) -> None:
    url = f"{two_cps[0].url}/v1/pipelines{path}"
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, json=body) as resp,
    ):
        assert resp.status == status, await resp.text()
        assert (await resp.json())["error"]["param"] == field


async def test_a_stage_without_policy_is_reported_as_such(
    clients: tuple[ControlPlaneClient, ControlPlaneClient],
) -> None:
    a, _ = clients
    status = await a.scale(PIPELINE, 1)
    assert (status.policy, status.desired, status.decision) == (None, None, None)
    with pytest.raises(ControlPlaneRequestError, match="no autoscale policy"):
        await a.wake_stage(PIPELINE, 1)


async def test_the_other_omni_cp_decides_once_the_holder_stops(
    two_cps: tuple[ControlPlaneProcess, ControlPlaneProcess],
    clients: tuple[ControlPlaneClient, ControlPlaneClient],
) -> None:
    """Last in the module: it stops one of the two omni-cp."""
    leader, follower = leader_of(two_cps)
    survivor = clients[0] if follower is two_cps[0] else clients[1]
    load = {"in_flight": 5}
    async with replicas(survivor, 1, load, count=1, port0=9730):
        await survivor.set_scale_policy(PIPELINE, 1, FAST, replicas=1)
        leader.terminate()  # a clean stop releases the lock at once
        load["in_flight"] = 10
        up = await until(lambda: survivor.scale(PIPELINE, 1), lambda s: s.desired == 2)
        assert up.decision is not None and up.decision.reason == "utilization"
        decided = r"autoscale up pipeline=synthetic stage=1 desired=1->2"
        assert re.search(decided, follower.proc.stderr)
    await survivor.remove_scale_policy(PIPELINE, 1)
