"""``omni-stage``: one stage pod (a sidecar and its engine process).

Parses flags, sets up logging and delegates to :mod:`omni_mesh.sidecar.app`. Configuration
errors (a bad flag, a bad deploy YAML, bad --stage-overrides) exit with code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from urllib.parse import urlsplit

from pydantic import ValidationError

from omni_mesh.configs.cli_flags import add_stage_flags, cli_overrides_from_args
from omni_mesh.configs.deploy import DeployConfigError
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.pipeline import PipelineError, get_pipeline
from omni_mesh.configs.stage_settings import StageSettings
from omni_mesh.data_plane.connectors import EdgeConnectors


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-stage", description=__doc__)
    p.add_argument("--pipeline", required=True, help="registered pipeline name")
    p.add_argument("--stage-id", type=int, default=0, help="stage this pod runs (default 0)")
    p.add_argument("--headless", action="store_true", help="serve no client API")
    p.add_argument("--api-only", action="store_true", help="client API only, no engine")
    p.add_argument(
        "--control-plane",
        action="append",
        default=[],
        metavar="URL",
        help="control plane URL (repeat or comma-separate for several omni-cp)",
    )
    p.add_argument("--omni-master-address", help="control plane host (alternative form)")
    p.add_argument("--omni-master-port", type=int, help="control plane port (alternative form)")
    p.add_argument("--cp-auth-token", help="control plane bearer token")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--advertise-address", help="URL other pods use to reach this one")
    p.add_argument("--host-id", help="machine identity for same-host hand-offs")
    p.add_argument("--deploy-config", help="deploy YAML (default: the pipeline's bundled one)")
    p.add_argument("--platform", help="platform section of the deploy YAML to apply")
    p.add_argument("--stage-overrides", help='per-stage JSON, e.g. \'{"1": {"max_num_seqs": 4}}\'')
    p.add_argument("--secret", help="deployment secret (or OMNI_SECRET)")
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--engine-start-timeout", type=float, default=300.0, metavar="S")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--tracing",
        choices=("none", "console", "otlp"),
        default="none",
        help="OpenTelemetry span exporter (default none)",
    )
    add_stage_flags(p)
    return p


def _control_planes(args: argparse.Namespace) -> tuple[str, ...]:
    urls = [u.strip() for item in args.control_plane for u in item.split(",") if u.strip()]
    if args.omni_master_port is not None and not args.omni_master_address:
        raise ValueError("--omni-master-port needs --omni-master-address")
    if args.omni_master_address:
        port = args.omni_master_port or 7700
        urls.append(f"http://{args.omni_master_address}:{port}")
    for url in urls:
        parts = urlsplit(url)
        try:
            port_ok = parts.port is not None
        except ValueError:
            port_ok = False
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            raise ValueError(f"--control-plane: {url!r} is not an http(s)://host:port URL")
    return tuple(u.rstrip("/") for u in urls)


def settings_from_args(args: argparse.Namespace) -> StageSettings:
    values: dict[str, object] = {
        "pipeline": args.pipeline,
        "stage_id": args.stage_id,
        "headless": args.headless,
        "api_only": args.api_only,
        "control_plane": _control_planes(args),
        "host": args.host,
        "port": args.port,
        "engine_threads": args.engine_threads,
        "engine_start_timeout_s": args.engine_start_timeout,
        "drain_timeout_s": args.drain_timeout,
        "log_level": args.log_level.upper(),
        "tracing": args.tracing,
    }
    optional = {
        "advertise_address": args.advertise_address,
        "host_id": args.host_id,
        "secret": args.secret,
        "cp_auth_token": args.cp_auth_token,
        "deploy_config": args.deploy_config,
    }
    values.update({k: v for k, v in optional.items() if v is not None})
    return StageSettings(**values)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        settings = settings_from_args(args)
        pipeline = get_pipeline(settings.pipeline)
        pipeline.stage(settings.stage_id)
        deploy = load_deploy_config(
            settings.deploy_config,
            pipeline,
            platform=args.platform,
            cli_overrides=cli_overrides_from_args(args),
            stage_overrides=args.stage_overrides,
            target_stages=[settings.stage_id],
        )
        connectors = EdgeConnectors(deploy, pipeline)  # a bad connector spec: exit 2 here
    except (ValidationError, DeployConfigError, PipelineError, ValueError) as exc:
        p.exit(2, f"omni-stage: error: {exc}\n")
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
    from omni_mesh.sidecar.engine_client import EngineStartError

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
