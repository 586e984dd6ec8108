"""``omni-stage``: one stage pod (a sidecar and its engine process).

Parses flags, sets up logging and delegates to :mod:`omni_mesh.sidecar.app`. Every setting has
a flag and an ``OMNI_STAGE_*`` variable; precedence, lowest first: defaults < bundled deploy YAML
< overlay < platform section < environment < flags < ``--stage-overrides``. Configuration errors
(a bad flag or variable, a bad deploy YAML, bad --stage-overrides, a pipeline module that does not
load) exit with code 2 and one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pydantic import ValidationError

from omni_mesh.configs.cli_flags import add_stage_flags, cli_overrides_from_args, env_overrides
from omni_mesh.configs.deploy import DeployConfig, DeployConfigError
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.pipeline_spec import PipelineError, PipelineSpec
from omni_mesh.configs.registry import (
    PIPELINE_MODULES_ENV,
    get_pipeline,
    load_pipeline_modules,
    pipeline_modules_from,
)
from omni_mesh.configs.settings_flags import (
    add_pipeline_module_flag,
    add_setting_flags,
    settings_error_text,
    settings_kwargs,
)
from omni_mesh.configs.stage_settings import STAGE_FLAGS, StageSettings
from omni_mesh.data_plane.connectors import EdgeConnectors


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-stage", description=__doc__)
    add_setting_flags(p, StageSettings, STAGE_FLAGS)
    add_pipeline_module_flag(p)
    add_stage_flags(p)
    return p


def settings_from_args(args: argparse.Namespace) -> StageSettings:
    """Flags beat ``OMNI_STAGE_*`` variables (read by pydantic-settings), which beat defaults."""
    return StageSettings(**settings_kwargs(args, STAGE_FLAGS))


def resolve(
    args: argparse.Namespace,
) -> tuple[StageSettings, PipelineSpec, DeployConfig, tuple[str, ...]]:
    """Settings, pipeline, deploy config and pipeline modules of one pod, from the flags and
    the environment; raises on bad input."""
    env = os.environ
    modules = pipeline_modules_from(args.pipeline_module, env)
    load_pipeline_modules(modules)
    settings = settings_from_args(args)
    pipeline = get_pipeline(settings.pipeline)
    pipeline.stage(settings.stage_id)
    deploy = load_deploy_config(
        settings.deploy_config,
        pipeline,
        platform=settings.platform,
        env_overrides=env_overrides(env),
        cli_overrides=cli_overrides_from_args(args),
        stage_overrides=settings.stage_overrides,
        target_stages=[settings.stage_id],
    )
    if settings.role != "both":
        if settings.api_only:
            raise ValueError(f"--role {settings.role}: an --api-only server runs no stage")
        if deploy.stage(settings.stage_id).prefill is None:
            raise ValueError(
                f"--role {settings.role}: stage {settings.stage_id} is not split into prefill "
                "and decode pools (its deploy entry has no prefill: block)"
            )
    stage = deploy.stage(settings.stage_id)
    if stage.devices is not None and not settings.api_only:
        stage.replica_devices(settings.replica_index)  # an index past the slots: ValueError
    return settings, pipeline, deploy, modules


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        settings, pipeline, deploy, modules = resolve(args)
        connectors = EdgeConnectors(deploy, pipeline)  # a bad connector spec: exit 2 here
    except ValidationError as exc:
        p.exit(2, f"omni-stage: error: {settings_error_text(exc, StageSettings, STAGE_FLAGS)}\n")
    except (DeployConfigError, PipelineError, ValueError) as exc:
        p.exit(2, f"omni-stage: error: {exc}\n")
    # The engine process (spawned by the sidecar) imports the same modules.
    os.environ[PIPELINE_MODULES_ENV] = ",".join(modules)
    logging.basicConfig(
        level=settings.log_level,
        format=f"%(asctime)s %(levelname)s stage[{settings.stage_id}] %(name)s: %(message)s",
    )
    import uvloop

    from omni_mesh.data_plane.memory import tune_malloc

    tune_malloc()  # large bodies reuse heap pages instead of page-faulting fresh mappings

    from omni_mesh.observability.tracing import TracingExporter, setup_tracing

    try:
        role = "api" if settings.api_only else f"stage-{settings.stage_id}"
        setup_tracing(f"omni-mesh {settings.pipeline} {role}", TracingExporter(settings.tracing))
    except ValueError as exc:
        p.exit(2, f"omni-stage: error: {exc}\n")

    from omni_mesh.sidecar.app import build_pod, serve
    from omni_mesh.sidecar.engine_link.client import EngineStartError

    async def run() -> int:
        pod = await build_pod(settings, pipeline, deploy, connectors)
        return await serve(pod)

    try:
        return uvloop.run(run())
    except EngineStartError as exc:
        if not exc.config_error:
            raise
        p.exit(2, f"omni-stage: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
