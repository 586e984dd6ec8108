"""omni-up's actuator follows a split stage's prefill pool (``prefill: {autoscale: …}``) as a
second pool of the stage: against a real omni-cp (embedded Redis) and a real supervisor, it
adopts the prefill replica omni-up started, starts a ``--role prefill`` replica in the pool's
next device slot when the prefill pool's desired count rises, and drains then retires one when
it falls, leaving the decode pool alone.

No vLLM engine runs (a split stage needs vLLM: its start-up is the suite's most expensive):
the pods are stand-in processes that sleep, registered with the control plane by the test
under their planned addresses, with ``kv_role=prefill`` and the load the test chooses. The
actuator's command lines are checked as planned (``--role prefill --replica-index N``)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import pytest

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.loader import bundled_deploy_path
from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    InstanceState,
    LoadReport,
    RegisterRequest,
    ScalePool,
)
from omni_mesh.launcher import cli as cli_up
from omni_mesh.launcher import local_deploy
from omni_mesh.launcher.autoscale import DRAIN_NOTICE_S, StageActuator, StagePool, _free_slot
from omni_mesh.launcher.planned import Planned
from omni_mesh.launcher.supervised_child import RestartPolicy
from omni_mesh.launcher.supervisor import Supervisor
from tests.procs import ControlPlaneProcess, start_control_plane, wait_until

pytestmark = pytest.mark.timeout(90)

T = TypeVar("T")
PIPELINE = "tiny-llm"
SLEEPER = (sys.executable, "-c", "import time; time.sleep(120)")
SPLIT = """\
stages:
  - stage_id: 0
    num_replicas: 1
    prefill:
      num_replicas: 1
      autoscale: {min_replicas: 1, max_replicas: 2, target_utilization: 0.5,
                  scale_up_window_s: 0, scale_down_window_s: 0, cooldown_s: 0}
"""


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlPlaneProcess]:
    proc = start_control_plane(
        None,
        lease_ttl_ms=10_000,
        sweep_interval_ms=100,
        extra_args=["--sweeper-lock-ttl-ms", "10000"],
        log_dir=tmp_path,
        name="omni-cp-prefill-actuator",
    )
    yield proc
    proc.proc.cleanup()


def on_cp(url: str, call: Callable[[ControlPlaneClient], Awaitable[T]]) -> T:
    """One control-plane call from this (synchronous) test."""

    async def run() -> T:
        client = ControlPlaneClient([url], timeout_s=5.0)
        try:
            return await call(client)
        finally:
            await client.close()

    return asyncio.run(run())


class Pods:
    """Stand-in prefill pods: registered at their planned address, heartbeating on demand."""

    def __init__(self, cp_url: str) -> None:
        self.cp_url = cp_url
        self.ids: dict[str, str] = {}  # address -> instance id
        self.load: dict[str, int] = {}

    def register(self, url: str, in_flight: int) -> str:
        req = RegisterRequest(
            pipeline=PIPELINE, stage_id=0, address=url, capacity=4, labels={"kv_role": "prefill"}
        )
        self.ids[url] = on_cp(self.cp_url, lambda c: c.register(req)).instance_id
        self.load[url] = in_flight
        self.beat()
        return self.ids[url]

    def beat(self) -> None:
        async def run(c: ControlPlaneClient) -> None:
            for url, instance_id in self.ids.items():
                await c.heartbeat(instance_id, LoadReport(in_flight=self.load[url], capacity=4))

        on_cp(self.cp_url, run)


@pytest.mark.integration
def test_the_actuator_starts_and_retires_prefill_replicas(
    cp: ControlPlaneProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="omni_mesh.launcher")
    overlay = tmp_path / "split.yaml"
    overlay.write_text(f"base_config: {bundled_deploy_path(PIPELINE)}\n{SPLIT}")
    argv = ["--pipeline", PIPELINE, "--deploy-config", str(overlay)]
    config = cli_up.parse_args(argv, {})
    assert config.autoscale == {} and config.autoscaled  # only the prefill pool autoscales
    first_slot = config.prefill_first_slot(0)
    assert first_slot == 1  # after the decode pool's one replica
    [prefill0] = [p for p in local_deploy.plan_stages(config, cp.url) if p.role == "prefill"]
    planned: list[tuple[int, int, ScalePool, Planned]] = []

    def plan(stage_id: int, n: int, slot: int, pool: ScalePool) -> Planned:
        role = "prefill" if pool is ScalePool.PREFILL else config.pool_role(stage_id)
        real = local_deploy.plan_replica(config, cp.url, stage_id, n, slot, role=role)
        planned.append((stage_id, slot, pool, real))
        return replace(real, argv=SLEEPER)  # the pod's stand-in

    pods = Pods(cp.url)
    sup = Supervisor(log_dir=tmp_path / "logs")
    policy = config.prefill_autoscale[0]
    try:
        child0 = sup.start(prefill0.name, SLEEPER, ready_url=prefill0.ready_url)
        pods.register(prefill0.url, in_flight=4)  # saturated: twice the target
        with StageActuator(
            sup, pipeline=PIPELINE, policies=config.autoscale, cp_url=cp.url,
            prefill_policies={0: (policy, first_slot)}, plan_replica=plan, env={},
            restart=RestartPolicy(), poll_s=0.05,
        ) as actuator:  # fmt: skip
            actuator.adopt([(prefill0, child0)])
            pool = actuator.prefill_pools[0]
            assert pool.children == [child0] and pool.slots == [(child0, 1)]
            actuator.start()

            def tick_until(ok: Callable[[], bool], message: str) -> None:
                def step() -> bool:
                    pods.beat()
                    actuator.tick()
                    return ok()

                wait_until(step, 30, interval=0.1, message=lambda: f"{message}: {planned}")

            # The prefill pool's desired count rises to 2: a --role prefill replica starts in
            # the pool's next slot; the decode pool is not touched.
            tick_until(lambda: len(pool.live()) == 2, "no prefill replica started")
            [(stage_id, slot, which, real)] = planned
            assert (stage_id, slot, which) == (0, 2, ScalePool.PREFILL)
            assert real.role == "prefill" and real.name == "stage0-llm-prefill-1"
            flags = " ".join(real.argv)
            assert "--role prefill" in flags and "--replica-index 2" in flags
            assert actuator.pools == {}
            started = pool.live()[1]
            started_id = pods.register(real.url, in_flight=0)

            # Load gone: back to 1; the newest replica is drained (out of discovery), then
            # retired (SIGTERM) once the drain notice has passed.
            pods.load[prefill0.url] = 0
            tick_until(lambda: len(pool.live()) == 1, "no prefill replica retired")
            assert pool.live() == [child0] and [c for c, _, _ in pool.leaving] == [started]
            listed = on_cp(cp.url, lambda c: c.instances(PIPELINE, 0, all=True))
            states = {i.instance_id: i.state for i in listed.instances}
            assert states[started_id] is InstanceState.DRAINING
            actuator.tick(time.monotonic() + DRAIN_NOTICE_S + 0.1)
            assert pool.leaving == [] and started.retiring_since is not None
            wait_until(lambda: started.returncode is not None, 10, interval=0.05)
            retiring = f"retiring process={started.name} pid={started.pid} (SIGTERM, drain): "
            assert f"{retiring}autoscale stage=0 pool=prefill replicas 2->1" in caplog.text
            assert len(planned) == 1  # nothing else started
    finally:
        sup.stop()
        sup.close()


@pytest.mark.unit
def test_a_new_prefill_replica_takes_a_slot_of_its_own_pool() -> None:
    """The prefill pool's slots start after the decode pool's: a decode replica's slot is
    never handed out, and the pool's own slots are used lowest first."""
    policy = AutoscaleConfig(min_replicas=1, max_replicas=2, standby_replicas=1)
    pool = StagePool(0, policy, ScalePool.PREFILL, first_slot=3)
    running = SimpleNamespace(returncode=None, retiring_since=None)
    assert _free_slot(pool) == 3
    pool.slots = [(running, 3)]  # type: ignore[list-item]
    assert _free_slot(pool) == 4
    pool.slots += [(running, 4), (running, 5)]  # type: ignore[list-item]
    assert _free_slot(pool) == 3  # every slot held: the least held, in the pool's range
