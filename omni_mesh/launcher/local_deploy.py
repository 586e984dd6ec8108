"""A whole pipeline on one machine, as local processes: the library behind ``omni-up``
(DESIGN §7).

:func:`plan_control_plane` and :func:`plan_stages` turn an :class:`UpConfig` into command
lines; :func:`run_local` starts them under a :class:`Supervisor` (``omni-cp serve`` first, then
every replica of every stage as a headless ``omni-stage``, then one API server) and waits until
each answers. While it runs, a process that dies is started again on the same port, with
exponential backoff (a restarted control plane starts empty: the pods re-register by
themselves); one that dies before it was ever ready, or fails too often, stops everything.

Stages with an ``autoscale:`` policy (``UpConfig.autoscale``) are then followed by the
:class:`~omni_mesh.launcher.autoscale.StageActuator`: their policies are set on the control
plane, and their pools grow and shrink (removal drains) to the desired counts it decides.

Stopping (``stop`` set) drains the deployment in pipeline order, so that no request in flight
is lost: the API server first, then stage 0's replicas, stage 1's, …, the control plane last,
each group gone (SIGTERM: a pod leaves the pool, finishes its work, exits) before the next gets
SIGTERM. Only a process that outlives ``stop_timeout_s`` is SIGKILLed (its own pid first, so its
engine still cleans up, then what is left of its process group); that is reported and makes the
run a failure. Last, a janitor removes shared-memory segments whose owner is gone.

Nothing here prints: the text for the user (the endpoint list, a failure) goes to the
caller's callbacks. The deployment secret reaches the stages as ``OMNI_SECRET`` in their
environment (not on their command line, which any local user can read).

The children inherit omni-up's environment except the variables of the settings omni-up
decides for each child itself (:func:`child_environment`): an ``OMNI_STAGE_HEADLESS=1`` in the
shell must not turn the API server (``--api-only``) into a clash, nor an
``OMNI_STAGE_ADVERTISE_ADDRESS`` give every replica one address.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.configs.settings import ControlPlaneSettings, LogLevel
from omni_mesh.configs.settings_flags import env_names
from omni_mesh.configs.stage_settings import StageSettings
from omni_mesh.control_plane.client import ScalePool
from omni_mesh.data_plane.shm_cleanup import (
    sweep_orphans,  # the host janitor, after the pods are gone
)
from omni_mesh.launcher.autoscale import StageActuator
from omni_mesh.launcher.planned import LOCALHOST, Planned
from omni_mesh.launcher.supervisor import (
    RestartPolicy,
    Supervisor,
    SupervisorError,
    free_port,
    port_in_use,
)

logger = logging.getLogger(__name__)

SECRET_ENV = "OMNI_SECRET"
#: omni-stage settings omni-up sets for each child (its role, address, control plane, what it
#: loads, how it stops, its secret): their ``OMNI_STAGE_*`` variables are not passed on.
CHILD_STAGE_SETTINGS = (
    "pipeline", "stage_id", "headless", "api_only", "control_plane", "omni_master_address",
    "omni_master_port", "host", "port", "advertise_address", "secret", "deploy_config",
    "stage_overrides", "drain_timeout_s", "log_level",
)  # fmt: skip
#: The same for the control plane child (``omni-cp serve --host --port --log-level``).
CHILD_CP_SETTINGS = ("host", "port", "log_level")
_FOLLOW_POLL_S = 0.1


@dataclass(frozen=True)
class UpConfig:
    """Validated ``omni-up`` flags."""

    pipeline: PipelineSpec
    replicas: tuple[int, ...]  # per stage, in stage id order
    host: str
    port: int
    cp_port: int | None
    deploy_config: Path | None
    stage_overrides: str | None  # JSON, validated, passed to every stage as given
    secret: str
    secret_source: str
    keep_logs: bool
    ready_timeout_s: float
    stop_timeout_s: float  # per stop group, SIGTERM to SIGKILL; at least drain_timeout_s
    log_level: LogLevel
    drain_timeout_s: float = 30.0  # every pod's --drain-timeout
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # Stages whose pool follows the control plane's desired count (the deploy config's
    # ``autoscale:``); their count in ``replicas`` is the starting one, 0 allowed.
    autoscale: Mapping[int, AutoscaleConfig] = field(default_factory=dict)
    scale_poll_s: float = 0.5  # how often the actuator reads the desired counts
    # Flags every omni-stage gets as given (--async-chunk, --pipeline-module M, …).
    stage_flags: tuple[str, ...] = ()
    # Split stages (the deploy config's ``prefill:``) and the size of their prefill pools
    # (the starting size of one that autoscales); their count in ``replicas`` is the decode
    # pool's.
    prefill: Mapping[int, int] = field(default_factory=dict)
    # Split stages whose prefill pool follows its own desired count (``prefill.autoscale:``).
    prefill_autoscale: Mapping[int, AutoscaleConfig] = field(default_factory=dict)

    def prefill_first_slot(self, stage_id: int) -> int:
        """The first replica slot of the stage's prefill pool: after its decode pool's (its
        replicas, or an autoscaled pool's largest size and its standbys)."""
        policy = self.autoscale.get(stage_id)
        if policy is not None:
            return policy.max_replicas + policy.standby_replicas
        return self.replicas[sorted(self.pipeline.stage_ids).index(stage_id)]

    @property
    def autoscaled(self) -> bool:
        """Whether any pool follows the control plane's desired count (the actuator runs)."""
        return bool(self.autoscale or self.prefill_autoscale)

    def pool_role(self, stage_id: int) -> str:
        """The ``--role`` of the stage's replicas counted in ``replicas``: ``decode`` for a
        split stage, else none."""
        return "decode" if stage_id in self.prefill else ""

    @property
    def replica_spec(self) -> str:
        return ":".join(str(n) for n in self.replicas)


# ---- the processes -----------------------------------------------------------------------------


def plan_control_plane(
    port: int, log_level: LogLevel = LogLevel.INFO, *, stop_rank: int = 0
) -> Planned:
    """``omni-cp serve`` with embedded Redis; ``stop_rank``: stop it after every stage."""
    argv = (sys.executable, "-m", "omni_mesh.control_plane", "serve")
    flags = ("--host", LOCALHOST, "--port", str(port), "--log-level", log_level.value)
    url = _url(LOCALHOST, port)
    return Planned("control-plane", (*argv, *flags), url, "control plane", "/healthz", stop_rank)


def plan_stages(config: UpConfig, cp_url: str) -> list[Planned]:
    """Every replica of every stage (headless, free ports), then the API server. Stop ranks:
    the API server 0, the stage with the k-th smallest id k + 1."""
    plans = []
    for stage_id, count in zip(sorted(config.pipeline.stage_ids), config.replicas, strict=True):
        for n in range(config.prefill.get(stage_id, 0)):
            slot = config.prefill_first_slot(stage_id) + n  # after the decode pool's slots
            plans.append(plan_replica(config, cp_url, stage_id, n, slot, role="prefill"))
        role = config.pool_role(stage_id)
        plans += [plan_replica(config, cp_url, stage_id, n, n, role=role) for n in range(count)]
    entry = str(config.pipeline.entry_stage_id)
    api = ("--stage-id", entry, "--api-only", "--host", config.host, "--port", str(config.port))
    url = _url(config.host, config.port)
    plans.append(Planned("api-server", (*_stage_cmd(config, cp_url), *api), url, "API server"))
    return plans


def plan_replica(
    config: UpConfig, cp_url: str, stage_id: int, replica: int, slot: int, *, role: str = ""
) -> Planned:
    """Replica number ``replica`` of ``stage_id``: a headless ``omni-stage`` on a free port,
    in replica slot ``slot`` (its slice of the stage's devices); ``role``: of a split stage's
    prefill or decode pool."""
    name = config.pipeline.stage(stage_id).name
    port = free_port(LOCALHOST)
    argv: tuple[str, ...] = ("--stage-id", str(stage_id), "--headless", "--host", LOCALHOST)
    argv += ("--port", str(port), "--replica-index", str(slot))
    argv += ("--role", role) if role else ()
    pool = f"{name}-{role}" if role else name
    return Planned(
        f"stage{stage_id}-{pool}-{replica}",
        (*_stage_cmd(config, cp_url), *argv),
        _url(LOCALHOST, port),
        f"stage {stage_id} {pool} #{replica}",
        stop_rank=stage_rank(config, stage_id),
        stage_id=stage_id,
        role=role,
        slot=slot,
    )


def stage_rank(config: UpConfig, stage_id: int) -> int:
    """When a stage's replicas stop: the stage with the k-th smallest id has rank k + 1."""
    return sorted(config.pipeline.stage_ids).index(stage_id) + 1


def _stage_cmd(config: UpConfig, cp_url: str) -> tuple[str, ...]:
    common = ["--pipeline", config.pipeline.name, "--control-plane", cp_url]
    common += ["--log-level", config.log_level.value]
    common += ["--drain-timeout", f"{config.drain_timeout_s:g}"]
    if config.deploy_config is not None:
        common += ["--deploy-config", str(config.deploy_config)]
    if config.stage_overrides is not None:
        common += ["--stage-overrides", config.stage_overrides]
    common += config.stage_flags
    return (sys.executable, "-m", "omni_mesh.sidecar.cli_stage", *common)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# ---- running -----------------------------------------------------------------------------------


def run_local(
    config: UpConfig,
    env: Mapping[str, str],
    stop: threading.Event,
    *,
    on_ready: Callable[[str], None],
    on_error: Callable[[str], None],
) -> bool:
    """Start everything, keep it up (restarting what dies) until ``stop`` is set or a process
    fails for good, stop everything in pipeline order, sweep orphaned shared memory.

    ``on_ready`` gets the endpoint list (see :func:`endpoints_text`) once every process
    answers. ``on_error`` gets the message for the user when a port is taken (nothing is
    started), when a process fails for good (given before the rest are stopped), and when a
    process had to be SIGKILLed while stopping (naming each); the logs are kept then. True
    after a clean stop, also one before everything was ready; False otherwise. A second
    signal (KeyboardInterrupt) while stopping kills what is left at once and propagates."""
    listens = [(config.host, config.port, "--port")]
    if config.cp_port is not None:
        listens.append((LOCALHOST, config.cp_port, "--cp-port"))
    for host, port, flag in listens:
        if port_in_use(host, port):
            on_error(f"cannot listen on {host}:{port} ({flag}): in use")
            return False
    sup = Supervisor(
        keep_logs=config.keep_logs, grace_s=config.stop_timeout_s, log_prefix="omni-up-"
    )
    child_env = child_environment(env, config.secret)
    ok = True
    try:
        cp_port = config.cp_port or free_port(LOCALHOST)
        last_rank = len(config.replicas) + 1
        plans = [plan_control_plane(cp_port, config.log_level, stop_rank=last_rank)]
        if _start(sup, plans, child_env, config, stop):
            plans += plan_stages(config, plans[0].url)
            if _start(sup, plans[1:], child_env, config, stop):
                if config.autoscaled:
                    _follow(sup, config, plans, child_env, stop, on_ready)
                else:
                    on_ready(endpoints_text(config, plans, sup.log_dir))
                    sup.wait(stop)
    except SupervisorError as exc:
        ok = False
        sup.keep_logs = True
        on_error(f"{exc}\nstopping everything; logs kept in {sup.log_dir}")
    finally:
        logger.info("stopping %d processes", len(sup.children))
        try:
            sup.stop()
        finally:
            removed = sweep_orphans()
            if removed:
                logger.warning("removed %d orphaned shared-memory segments", removed)
            if sup.killed:
                ok = False
                sup.keep_logs = True
                killed = "\n".join(f"  {what}" for what in sup.killed)
                on_error(f"had to SIGKILL:\n{killed}\nlogs kept in {sup.log_dir}")
            sup.close()
    return ok


def child_environment(env: Mapping[str, str], secret: str) -> dict[str, str]:
    """The environment of every child: omni-up's own, less the variables of the settings
    omni-up gives each child explicitly (:data:`CHILD_STAGE_SETTINGS`,
    :data:`CHILD_CP_SETTINGS`), plus the deployment secret."""
    owned = {n for f in CHILD_STAGE_SETTINGS for n in env_names(StageSettings, f)}
    owned |= {n for f in CHILD_CP_SETTINGS for n in env_names(ControlPlaneSettings, f)}
    dropped = sorted(k for k in env if k in owned)
    if dropped:
        logger.info(
            "not passed to the children (omni-up sets these itself): %s", ", ".join(dropped)
        )
    kept = {k: v for k, v in env.items() if k not in owned}
    return {**kept, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}


def _follow(
    sup: Supervisor,
    config: UpConfig,
    plans: Sequence[Planned],
    env: Mapping[str, str],
    stop: threading.Event,
    on_ready: Callable[[str], None],
) -> None:
    """Run with the autoscaling actuator: set the policies, then until ``stop`` keep the
    children up and the autoscaled pools at their desired counts."""
    cp_url = plans[0].url

    def plan(stage_id: int, n: int, slot: int, pool: ScalePool) -> Planned:
        role = "prefill" if pool is ScalePool.PREFILL else config.pool_role(stage_id)
        return plan_replica(config, cp_url, stage_id, n, slot, role=role)

    with StageActuator(
        sup,
        pipeline=config.pipeline.name,
        policies=config.autoscale,
        prefill_policies={
            stage_id: (policy, config.prefill_first_slot(stage_id))
            for stage_id, policy in config.prefill_autoscale.items()
        },
        cp_url=cp_url,
        plan_replica=plan,
        env=env,
        restart=replace(config.restart, ready_timeout_s=config.ready_timeout_s),
        poll_s=config.scale_poll_s,
    ) as actuator:
        actuator.adopt(zip(plans, sup.children, strict=True))
        actuator.start()
        on_ready(endpoints_text(config, plans, sup.log_dir))
        while not stop.wait(_FOLLOW_POLL_S):
            sup.check()
            actuator.tick()


def _start(
    sup: Supervisor,
    plans: Sequence[Planned],
    env: Mapping[str, str],
    config: UpConfig,
    stop: threading.Event,
) -> bool:
    """Start ``plans`` and wait until each answers; False when ``stop`` was set first."""
    policy = replace(config.restart, ready_timeout_s=config.ready_timeout_s)
    children = [
        sup.start(
            p.name, p.argv, env=env, ready_url=p.ready_url, stop_rank=p.stop_rank, restart=policy
        )
        for p in plans
    ]
    return sup.wait_ready(children, timeout_s=config.ready_timeout_s, cancel=stop)


def endpoints_text(config: UpConfig, plans: Sequence[Planned], log_dir: Path) -> str:
    """One line per process with its URL, the secret's source and the log folder, then the
    ``omni-up ready: …`` line."""
    width = max(len(p.label) for p in plans)
    lines = [f"  {p.label:<{width}}  {p.url}" for p in plans]
    kept = "kept" if config.keep_logs else "removed on exit; --keep-logs keeps them"
    lines.append(f"  {'secret':<{width}}  {config.secret_source} (stages get it as ${SECRET_ENV})")
    lines.append(f"  {'logs':<{width}}  {log_dir} ({kept})")
    lines.append(
        f"omni-up ready: {_url(config.host, config.port)} "
        f"(pipeline {config.pipeline.name}, replicas {config.replica_spec})"
    )
    return "\n".join(lines)
