"""``omni-up``: a whole pipeline on one machine, as local processes (DESIGN §7).

    omni-up --pipeline tiny-omni --replicas 1:2:1 --port 8000

Starts ``omni-cp serve`` (embedded Redis), every replica of every stage as a headless
``omni-stage``, and one API server (``--api-only``) on ``--port``; waits until each answers;
prints the endpoints and a final ``omni-up ready: …`` line; stays up until Ctrl-C or SIGTERM.

A stage whose deploy entry has ``autoscale:`` follows the control plane's desired replica count
(:mod:`omni_mesh.launcher.autoscale`): ``--replicas`` gives its starting count (0 allowed when
its ``min_replicas`` is 0), replicas are started on free ports and removed by draining them.
A split stage's prefill pool with an ``autoscale:`` of its own (``prefill: {autoscale: …}``)
follows its own desired count the same way, starting at its ``prefill.num_replicas``.

A process that dies while it runs is restarted on the same port with exponential backoff
(0.5 s doubling to 10 s); omni-up gives up, stops everything, names the process and exits 1 only
when one dies before it was ever ready or fails 5 times within 60 s.

Ctrl-C or SIGTERM drains the deployment in pipeline order — the API server, then stage 0's
replicas, stage 1's, …, the control plane last, each group gone before the next is told to stop
— so the requests in flight finish. Each pod drains for up to ``--drain-timeout``; a process
still running ``--stop-timeout`` after its SIGTERM is SIGKILLed, which omni-up reports, exiting
1; otherwise it exits 0. A second Ctrl-C kills what is left at once (exit 130). Orphaned
shared-memory segments are removed at the end. Bad flags exit 2.

The deployment secret comes from ``--secret``, else ``OMNI_SECRET``, else is generated; the
stages get it as ``OMNI_SECRET`` in their environment (not on their command line, which any
local user can read). The processes are planned and run by
:mod:`omni_mesh.launcher.local_deploy`; this module parses the flags, sets up logging and signals,
and prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.cli_flags import env_overrides
from omni_mesh.configs.deploy import MAX_REPLICAS, DeployConfig, DeployConfigError
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.pipeline_spec import PipelineError, PipelineSpec
from omni_mesh.configs.registry import (
    PIPELINE_MODULES_ENV,
    get_pipeline,
    load_pipeline_modules,
    pipeline_modules_from,
)
from omni_mesh.configs.settings import UpSettings
from omni_mesh.configs.settings_flags import (
    add_pipeline_module_flag,
    add_setting_flags,
    env_kwargs,
    flag_specs,
    settings_error_text,
    settings_kwargs,
)
from omni_mesh.launcher.local_deploy import SECRET_ENV, UpConfig, run_local

logger = logging.getLogger(__name__)

MIN_SECRET_CHARS = 16
DEFAULT_DRAIN_S = 30.0  # omni-stage's default
MAX_DRAIN_S = 3600.0
STOP_MARGIN_S = 10.0  # beyond the drain: the pod stops its engine and exits


# ---- flags -------------------------------------------------------------------------------------


UP_FLAGS = flag_specs(
    UpSettings,
    aliases={
        "ready_timeout_s": ("--ready-timeout",),
        "drain_timeout_s": ("--drain-timeout",),
        "stop_timeout_s": ("--stop-timeout",),
    },
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-up",
        description="Run a whole pipeline on this machine: control plane, every stage replica "
        "and an API server, until Ctrl-C. Every flag also reads an OMNI_UP_* variable; flags win.",
    )
    add_setting_flags(p, UpSettings, UP_FLAGS)
    add_pipeline_module_flag(p)
    return p


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str]) -> UpConfig:
    """Parse and validate; a bad flag exits 2 with a message naming it.

    Precedence, lowest first: defaults < bundled deploy YAML < overlay < environment
    (``OMNI_UP_*`` for these settings, ``OMNI_STAGE_*`` for deploy settings) < flags (``--replicas``
    is one) < ``--stage-overrides``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        modules = pipeline_modules_from(args.pipeline_module, env)
        load_pipeline_modules(modules)
        kwargs = {**env_kwargs(UpSettings, UP_FLAGS, env), **settings_kwargs(args, UP_FLAGS)}
        try:
            settings = UpSettings(**kwargs)
        except ValidationError as exc:
            raise ValueError(settings_error_text(exc, UpSettings, UP_FLAGS)) from None
        pipeline = get_pipeline(settings.pipeline)
        deploy_path = None if settings.deploy_config is None else settings.deploy_config.resolve()
        if deploy_path is not None and not deploy_path.is_file():
            raise ValueError(f"--deploy-config: no such file: {deploy_path}")
        # Fail here, once, rather than in every stage process.
        deploy, replicas = load_with_replicas(deploy_path, pipeline, settings, env)
        autoscale = autoscaled_stages(pipeline, deploy, replicas)
        secret_flag = None if settings.secret is None else settings.secret.get_secret_value()
        secret, source = resolve_secret(secret_flag, env)
        stop_timeout = resolve_stop_timeout(settings.drain_timeout_s, settings.stop_timeout_s)
    except (PipelineError, DeployConfigError, ValueError) as exc:
        parser.error(str(exc))
    stage_flags: list[str] = []
    if settings.async_chunk is not None:
        stage_flags.append("--async-chunk" if settings.async_chunk else "--no-async-chunk")
    for module in modules:
        stage_flags += ["--pipeline-module", module]
    return UpConfig(
        pipeline=pipeline,
        replicas=replicas,
        host=settings.host,
        port=settings.port,
        cp_port=settings.cp_port,
        deploy_config=deploy_path,
        stage_overrides=settings.stage_overrides,
        secret=secret,
        secret_source=source,
        keep_logs=settings.keep_logs,
        ready_timeout_s=settings.ready_timeout_s,
        stop_timeout_s=stop_timeout,
        log_level=settings.log_level,
        drain_timeout_s=settings.drain_timeout_s,
        autoscale=autoscale,
        stage_flags=tuple(stage_flags),
        prefill=split_stages(pipeline, deploy),
        prefill_autoscale=autoscaled_prefill_pools(pipeline, deploy),
    )


def load_with_replicas(
    path: Path | None, pipeline: PipelineSpec, settings: UpSettings, env: Mapping[str, str]
) -> tuple[DeployConfig, tuple[int, ...]]:
    """The deploy config every stage will load, with ``--replicas`` as a flag layer (above the
    environment, below ``--stage-overrides``), and the replica count of each stage from it."""
    cli = {} if settings.async_chunk is None else {"async_chunk": settings.async_chunk}
    layers: dict[str, Any] = {
        "env_overrides": env_overrides(env),
        "cli_overrides": cli,
        "stage_overrides": settings.stage_overrides,
    }
    if settings.replicas is None:
        deploy = load_deploy_config(path, pipeline, **layers)
        return deploy, parse_replicas(None, pipeline, deploy)
    # The counts take part in the config's own checks (a stage's devices cover its replicas),
    # so the config is loaded with them; a 0 (allowed only where autoscale may scale the stage
    # to zero, which the loaded config says) is loaded as 1 until that is known.
    stage_ids = sorted(pipeline.stage_ids)
    try:
        given = parse_replicas(settings.replicas, pipeline, least=0)
    except ValueError:  # said with the bounds of each stage, which the config knows
        parse_replicas(settings.replicas, pipeline, load_deploy_config(path, pipeline, **layers))
        raise

    def loaded(counts: tuple[int, ...]) -> DeployConfig:
        per_stage = {sid: {"num_replicas": n} for sid, n in zip(stage_ids, counts, strict=True)}
        return load_deploy_config(path, pipeline, cli_stage_overrides=per_stage, **layers)

    deploy = loaded(tuple(max(n, 1) for n in given))
    counts = parse_replicas(settings.replicas, pipeline, deploy)
    if 0 in counts:
        deploy = loaded(counts)
    return deploy, parse_replicas(None, pipeline, deploy)


def parse_replicas(
    spec: str | None,
    pipeline: PipelineSpec,
    deploy: DeployConfig | None = None,
    *,
    least: int | None = None,
) -> tuple[int, ...]:
    """``1:2:1`` → (1, 2, 1): one positive count per stage (0 where ``deploy``'s autoscale
    may scale the stage to zero; ``least`` overrides that), in stage id order. Without a
    spec, each stage's ``num_replicas`` from ``deploy`` (1 without a deploy config)."""
    stage_ids = sorted(pipeline.stage_ids)
    if spec is None:
        return tuple(deploy.stage(k).num_replicas if deploy else 1 for k in stage_ids)
    counts = spec.split(":")
    if len(counts) != len(stage_ids):
        names = ", ".join(pipeline.stage(k).name for k in stage_ids)
        raise ValueError(
            f"--replicas {spec!r} gives {len(counts)} count(s) but pipeline {pipeline.name!r} "
            f"has {len(stage_ids)} stages ({names}): give one per stage, "
            f"e.g. {':'.join('1' * len(stage_ids))}"
        )
    out = []
    for stage_id, count in zip(stage_ids, counts, strict=True):
        scale = deploy.stage(stage_id).autoscale if deploy else None
        low = 0 if scale is not None and scale.min_replicas == 0 else 1
        low = low if least is None else least
        text = count.strip()
        if not text.isdigit() or not low <= int(text) <= MAX_REPLICAS:
            raise ValueError(
                f"--replicas: the count for stage {stage_id} ({pipeline.stage(stage_id).name}) "
                f"must be an integer from {low} to {MAX_REPLICAS}, got {count!r}"
            )
        out.append(int(text))
    return tuple(out)


def autoscaled_stages(
    pipeline: PipelineSpec, deploy: DeployConfig | None, replicas: tuple[int, ...]
) -> dict[int, AutoscaleConfig]:
    """The stages with ``autoscale:`` in ``deploy`` and their policies; the starting count of
    each (from ``--replicas``) must lie within its ``[min_replicas, max_replicas]``."""
    if deploy is None:
        return {}
    out = {}
    for stage_id, count in zip(sorted(pipeline.stage_ids), replicas, strict=True):
        scale = deploy.stage(stage_id).autoscale
        if scale is None:
            continue
        if not scale.min_replicas <= count <= scale.max_replicas:
            raise ValueError(
                f"--replicas: stage {stage_id} ({pipeline.stage(stage_id).name}) is autoscaled "
                f"from {scale.min_replicas} to {scale.max_replicas} replicas; its starting count "
                f"{count} is outside that range"
            )
        out[stage_id] = scale
    return out


def split_stages(pipeline: PipelineSpec, deploy: DeployConfig | None) -> dict[int, int]:
    """The stages split into prefill and decode pools (``prefill:``) and their prefill pools'
    sizes."""
    if deploy is None:
        return {}
    out = {}
    for stage_id in sorted(pipeline.stage_ids):
        pool = deploy.stage(stage_id).prefill
        if pool is not None:
            out[stage_id] = pool.num_replicas
    return out


def autoscaled_prefill_pools(
    pipeline: PipelineSpec, deploy: DeployConfig | None
) -> dict[int, AutoscaleConfig]:
    """The split stages whose prefill pool autoscales (``prefill: {autoscale: …}``) and its
    policy; the pool's starting count is its ``num_replicas`` (checked by the deploy model)."""
    if deploy is None:
        return {}
    out = {}
    for stage_id in sorted(pipeline.stage_ids):
        pool = deploy.stage(stage_id).prefill
        if pool is not None and pool.autoscale is not None:
            out[stage_id] = pool.autoscale
    return out


def resolve_stop_timeout(drain_s: float, stop_s: float | None) -> float:
    """The grace from SIGTERM to SIGKILL: at least the pods' drain timeout (a draining pod
    must not be killed for doing its job); by default that plus a margin to stop the engine."""
    if not 0 <= drain_s <= MAX_DRAIN_S:
        raise ValueError(f"--drain-timeout must be from 0 to {MAX_DRAIN_S:g} seconds")
    if stop_s is None:
        return drain_s + STOP_MARGIN_S
    if stop_s < drain_s:
        raise ValueError(
            f"--stop-timeout ({stop_s:g}) must be at least --drain-timeout ({drain_s:g}): "
            "a pod may take that long to finish its in-flight requests"
        )
    return stop_s


def resolve_secret(flag: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """The secret and where it came from."""
    if flag is not None:
        secret, source, name = flag, "--secret", "--secret"
    elif env.get(SECRET_ENV):
        secret, source, name = env[SECRET_ENV], f"${SECRET_ENV}", SECRET_ENV
    else:
        return secrets.token_hex(32), "generated for this run"
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{name}: must be at least {MIN_SECRET_CHARS} characters")
    return secret, source


# ---- running -----------------------------------------------------------------------------------


def _print_ready(text: str) -> None:
    print(text, flush=True)


def _print_error(text: str) -> None:
    for line in text.splitlines():
        print(f"omni-up: {line}", file=sys.stderr)


def _handle_signals(stop: threading.Event) -> None:
    """First SIGINT/SIGTERM: stop gracefully. A second one: stop now (KeyboardInterrupt)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        logger.info("got %s; stopping (again: kill at once)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv, os.environ)
    # Every process omni-up starts (the control plane and each pod) imports the same modules.
    flags = config.stage_flags
    modules = [flags[i + 1] for i, flag in enumerate(flags) if flag == "--pipeline-module"]
    if modules:
        os.environ[PIPELINE_MODULES_ENV] = ",".join(modules)
    logging.basicConfig(
        level=config.log_level.as_int, format="%(asctime)s omni-up %(levelname)s %(message)s"
    )
    stop = threading.Event()
    _handle_signals(stop)
    try:
        ok = run_local(config, os.environ, stop, on_ready=_print_ready, on_error=_print_error)
    except KeyboardInterrupt:
        print("omni-up: interrupted; processes killed", file=sys.stderr)
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
