"""``omni-up``'s autoscaling actuator: the local pools of the autoscaled stages follow the
control plane's desired replica counts (DESIGN §9, "Autoscaling"; docs/operations.md).

At start (:meth:`StageActuator.start`) each stage whose deploy entry has ``autoscale:`` gets its
policy ``PUT`` on the control plane's stage scale resource, with the replicas omni-up started
as the starting desired count. A split stage's prefill pool with an ``autoscale:`` of its own
(``prefill: {autoscale: …}``) is a second pool of the stage, with its own policy on the
resource's ``?pool=prefill`` variant: it is followed the same way, with ``--role prefill``
replicas in the replica slots after the decode pool's. Then :meth:`StageActuator.tick`
(called from the supervisor's thread every ``poll_s``) reads each pool's scale resource and

- re-``PUT``s the policy when the control plane answers ``policy: null`` (it was restarted, or
  Redis lost its data), with the replicas running now as the starting count;
- starts replicas while fewer run (or start) than desired: a headless ``omni-stage`` on a free
  port, which joins its pool by itself once its engine is READY;
- retires replicas while more run than desired, newest first (those still starting before
  those serving): first the control plane drains it (``POST /v1/instances/{id}/drain``: it
  leaves discovery, and every sender's pool, while it still serves), ``DRAIN_NOTICE_S`` later it
  gets SIGTERM, so it finishes its in-flight work and exits 0 (its own drain); the supervisor
  does not restart a retired replica. Without that notice a sender whose cached pool still
  lists the replica could hit its closed port and spend a retry.

Every action is logged with the decision's reason and inputs. The control plane being
unreachable changes nothing: the pools keep their size until it answers again.

The control-plane client is async; the actuator runs it on a private event loop (one call at
a time, each bounded by the client's timeout), so that starting children stays on the
supervisor's thread (their parent-death signal is tied to it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    ControlPlaneError,
    InstanceState,
    ScalePool,
    ScaleStatus,
)
from omni_mesh.launcher.planned import Planned
from omni_mesh.launcher.supervisor import Child, RestartPolicy, Supervisor

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLIENT_TIMEOUT_S = 1.0  # one control-plane call; the supervisor's thread waits for it
DRAIN_NOTICE_S = 2.0  # from leaving discovery to SIGTERM: the watch reaches every sender
QUIET_S = 30.0  # between two "control plane unreachable" warnings per stage


@dataclass
class StagePool:
    """The replicas omni-up runs for one autoscaled pool: a stage's own (a split stage's decode
    pool), or a split stage's prefill pool."""

    stage_id: int
    policy: AutoscaleConfig
    pool: ScalePool = ScalePool.STAGE
    first_slot: int = 0  # its replica slots are first_slot + [0, max_replicas + standbys)
    children: list[Child] = field(default_factory=list)  # oldest first, none retiring
    leaving: list[tuple[Child, float, str]] = field(default_factory=list)  # SIGTERM due at, why
    next_replica: int = 0  # number of the next replica's name
    # Each child's replica slot (its slice of the stage's devices), kept until it has exited.
    slots: list[tuple[Child, int]] = field(default_factory=list)
    warned_at: float = -QUIET_S

    def live(self) -> list[Child]:
        self.children = [c for c in self.children if c.retiring_since is None]
        return self.children

    @property
    def where(self) -> str:
        """``stage=N`` (``stage=N pool=prefill``) for logs."""
        return self.pool.where(self.stage_id)


class StageActuator:
    """Makes omni-up's autoscaled pools follow the control plane's desired counts; see the
    module docstring. Close it when done."""

    def __init__(
        self,
        sup: Supervisor,
        *,
        pipeline: str,
        policies: Mapping[int, AutoscaleConfig],
        cp_url: str,
        plan_replica: Callable[[int, int, int, ScalePool], Planned],
        env: Mapping[str, str],
        restart: RestartPolicy,
        poll_s: float,
        prefill_policies: Mapping[int, tuple[AutoscaleConfig, int]] | None = None,
    ) -> None:
        """``policies``: stage id -> the stage's policy. ``prefill_policies``: stage id -> the
        policy of its prefill pool and the pool's first replica slot. ``plan_replica(stage_id,
        n, slot, pool)``: the command line of the pool's replica number n in ``slot``."""
        self._sup = sup
        self._pipeline = pipeline
        self._plan_replica = plan_replica
        self._env = dict(env)
        self._restart = restart
        self.poll_s = poll_s
        self._loop = asyncio.new_event_loop()
        self._client = ControlPlaneClient(cp_url, timeout_s=CLIENT_TIMEOUT_S)
        self._next_tick = 0.0
        self.pools: dict[int, StagePool] = {
            stage_id: StagePool(stage_id, policy) for stage_id, policy in sorted(policies.items())
        }
        self.prefill_pools: dict[int, StagePool] = {
            stage_id: StagePool(stage_id, policy, ScalePool.PREFILL, first_slot)
            for stage_id, (policy, first_slot) in sorted((prefill_policies or {}).items())
        }

    def all_pools(self) -> list[StagePool]:
        """Every autoscaled pool: the stages' own, then the prefill pools."""
        return [*self.pools.values(), *self.prefill_pools.values()]

    # ---- lifecycle -------------------------------------------------------------------------

    def adopt(self, started: Iterable[tuple[Planned, Child]]) -> None:
        """Take over the replicas omni-up started for the autoscaled pools (a split stage's
        prefill replicas go to its prefill pool when that autoscales; else it keeps its
        size)."""
        for plan, child in started:
            if plan.stage_id is None:
                continue
            pools = self.prefill_pools if plan.role == "prefill" else self.pools
            pool = pools.get(plan.stage_id)
            if pool is not None:
                pool.children.append(child)
                pool.slots.append((child, plan.slot))
                pool.next_replica += 1

    def start(self) -> None:
        """Set every autoscaled pool's policy on the control plane (starting count: the
        replicas running now). One the control plane does not take now is set by a later
        :meth:`tick`."""
        for pool in self.all_pools():
            try:
                status = self._put_policy(pool)
            except ControlPlaneError as exc:
                self._warn(pool, f"cannot set its policy yet: {exc}")
                continue
            logger.info(
                "autoscale %s policy set: min=%d max=%d target_utilization=%g "
                "replicas=%d desired=%s",
                pool.where,
                pool.policy.min_replicas,
                pool.policy.max_replicas,
                pool.policy.target_utilization,
                len(pool.live()),
                status.desired,
            )

    def close(self) -> None:
        """Close the control-plane client and the private event loop."""
        try:
            self._run(self._client.close())
        finally:
            self._loop.close()

    def __enter__(self) -> StageActuator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- following the desired counts -------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """SIGTERM the drained replicas that are due; every ``poll_s``: read each autoscaled
        pool's desired count and act on it."""
        now = time.monotonic() if now is None else now
        for pool in self.all_pools():
            due = [leaving for leaving in pool.leaving if leaving[1] <= now]
            pool.leaving = [leaving for leaving in pool.leaving if leaving[1] > now]
            for child, _, why in due:
                self._sup.retire(child, why)
        if now < self._next_tick:
            return
        self._next_tick = now + self.poll_s
        for pool in self.all_pools():
            try:
                status = self._run(
                    self._client.scale(self._pipeline, pool.stage_id, pool=pool.pool)
                )
                if status.policy is None:
                    logger.warning(
                        "autoscale %s: the control plane has no policy for it (restarted, "
                        "or Redis lost its data); setting it again with replicas=%d",
                        pool.where,
                        len(pool.live()),
                    )
                    status = self._put_policy(pool)
            except ControlPlaneError as exc:
                self._warn(pool, f"cannot read its desired replicas: {exc}")
                continue
            if status.desired is not None:
                self._reconcile(pool, status.desired, status)

    def _reconcile(self, pool: StagePool, desired: int, status: ScaleStatus) -> None:
        if pool.policy.standby_replicas:
            self._reconcile_standby(pool, desired, status)
            return
        live = pool.live()
        have = len(live)
        if desired == have:
            return
        why = _reason(status, have, desired)
        if desired > have:
            for _ in range(desired - have):
                self._start_replica(pool, why)
            return
        # Newest first, those still starting before those serving.
        order = sorted(live, key=lambda c: (c.ready, -c.started_at))
        self._retire(pool, order[: have - desired], why)

    def _reconcile_standby(self, pool: StagePool, desired: int, status: ScaleStatus) -> None:
        """A stage with warm standbys runs ``desired`` serving replicas and
        ``standby_replicas`` more. The control plane promotes standbys into the pool when it
        needs replicas (at once); here every replica starts as a standby, so a promoted one is
        replaced in the background, and the surplus leaves: serving replicas above the
        desired count first (drained), then the newest starting or standby ones."""
        live = pool.live()
        states = self._states(pool)
        if states is None:
            return
        serving: list[Child] = []
        spare: list[Child] = []
        for child in sorted(live, key=lambda c: -c.started_at):  # newest first
            state = states.get(_port(child.ready_url or ""))
            (spare if state in (None, InstanceState.STANDBY) else serving).append(child)
        spare.sort(key=lambda c: c.ready)  # still starting before loaded standbys
        target = desired + pool.policy.standby_replicas
        leaving = serving[: max(0, len(serving) - desired)]
        remaining = len(live) - len(leaving)
        leaving += spare[: max(0, remaining - target)]
        why = _reason(status, len(serving), desired) + f" standby={len(spare)}"
        for _ in range(target - remaining):
            self._start_replica(pool, why, standby=True)
        if leaving:
            self._retire(pool, leaving, why)

    def _states(self, pool: StagePool) -> dict[int | None, InstanceState] | None:
        """The control plane's state of every registered replica of the stage, by port."""
        try:
            snapshot = self._run(self._client.instances(self._pipeline, pool.stage_id, all=True))
        except ControlPlaneError as exc:
            self._warn(pool, f"cannot list its replicas: {exc}")
            return None
        return {_port(i.address): i.state for i in snapshot.instances}

    def _retire(self, pool: StagePool, leaving: list[Child], why: str) -> None:
        drained = self._drain(pool, leaving, why)
        due = time.monotonic() + DRAIN_NOTICE_S
        for child in leaving:
            pool.children.remove(child)
            reason = f"autoscale {pool.where} {why}"
            if child in drained:
                pool.leaving.append((child, due, reason))
            else:  # not registered (still starting), or no control plane: its own drain
                self._sup.retire(child, reason)

    def _drain(self, pool: StagePool, children: list[Child], why: str) -> list[Child]:
        """Take ``children`` out of discovery (control-plane drain); those it drained."""
        try:
            snapshot = self._run(self._client.instances(self._pipeline, pool.stage_id, all=True))
        except ControlPlaneError as exc:
            self._warn(pool, f"cannot list its replicas to drain them: {exc}")
            return []
        by_port = {_port(i.address): i.instance_id for i in snapshot.instances}
        drained = []
        for child in children:
            instance_id = by_port.get(_port(child.ready_url or ""))
            if instance_id is None:
                continue
            try:
                self._run(self._client.drain(instance_id, reason=f"autoscale {why}"[:200]))
            except ControlPlaneError as exc:
                self._warn(pool, f"cannot drain instance={instance_id}: {exc}")
                continue
            logger.info(
                "autoscale %s drained process=%s instance=%s: SIGTERM in %gs",
                pool.where,
                child.name,
                instance_id,
                DRAIN_NOTICE_S,
            )
            drained.append(child)
        return drained

    def _start_replica(self, pool: StagePool, why: str, *, standby: bool = False) -> None:
        plan = self._plan_replica(pool.stage_id, pool.next_replica, _free_slot(pool), pool.pool)
        pool.next_replica += 1
        child = self._sup.start(
            plan.name,
            (*plan.argv, "--standby") if standby else plan.argv,
            env=self._env,
            ready_url=plan.ready_url,
            stop_rank=plan.stop_rank,
            restart=self._restart,
            probe=True,
        )
        pool.children.append(child)
        pool.slots.append((child, plan.slot))
        logger.info(
            "autoscale %s starting %sprocess=%s pid=%d on %s: %s",
            pool.where,
            "standby " if standby else "",
            plan.name,
            child.pid,
            plan.url,
            why,
        )

    # ---- plumbing ----------------------------------------------------------------------------

    def _put_policy(self, pool: StagePool) -> ScaleStatus:
        replicas = pool.policy.clamp(len(pool.live()))
        coro = self._client.set_scale_policy(
            self._pipeline, pool.stage_id, pool.policy, replicas=replicas, pool=pool.pool
        )
        return self._run(coro)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    def _warn(self, pool: StagePool, what: str) -> None:
        now = time.monotonic()
        if now - pool.warned_at >= QUIET_S:
            pool.warned_at = now
            logger.warning("autoscale %s %s (keeping %d replicas)", pool.where, what,
                           len(pool.live()))  # fmt: skip


def _free_slot(pool: StagePool) -> int:
    """The replica slot (slice of the stage's devices) for a new replica of the pool: the
    lowest of its slots that no replica holds (a retired one holds its slot until it has
    exited; one that crashed keeps it: the supervisor restarts it in the same slot); when
    every slot is held, the least held one."""
    pool.slots = [
        (child, slot)
        for child, slot in pool.slots
        if child.retiring_since is None or child.returncode is None
    ]
    held = [0] * (pool.policy.max_replicas + pool.policy.standby_replicas)
    for _, slot in pool.slots:
        if 0 <= slot - pool.first_slot < len(held):
            held[slot - pool.first_slot] += 1
    return pool.first_slot + held.index(min(held))


def _port(url: str) -> int | None:
    """The port of ``http://host:port[/path]``; None when there is none."""
    port = urlsplit(url).port if url else None
    return port


def _reason(status: ScaleStatus, have: int, desired: int) -> str:
    """``replicas 1->3 (reason=utilization utilization=0.93 ready=1 in_flight=…)``."""
    text = f"replicas {have}->{desired}"
    d = status.decision
    if d is None:
        return f"{text} (starting count)"
    i = d.inputs
    return (
        f"{text} (reason={d.reason} utilization={i.utilization:.2f} ready={i.ready} "
        f"in_flight={i.in_flight} queued={i.queued} wake_waiting={i.wake_waiting})"
    )
