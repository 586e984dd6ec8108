"""``omni-up``: a whole pipeline on one machine, as local processes (DESIGN §7).

    omni-up --pipeline tiny-omni --replicas 1:2:1 --port 8000

Starts ``omni-cp serve`` (embedded Redis), every replica of every stage as a headless
``omni-stage``, and one API server (``--api-only``) on ``--port``; waits until each answers;
prints the endpoints and a final ``omni-up ready: …`` line; stays up until Ctrl-C or SIGTERM,
then stops everything (a second Ctrl-C kills at once) and exits 0. When any process dies
unexpectedly it stops the rest, names the process and exits 1. Bad flags exit 2.

The deployment secret comes from ``--secret``, else ``OMNI_SECRET``, else is generated; the
stages get it as ``OMNI_SECRET`` in their environment (not on their command line, which any
local user can read).
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
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from omni_mesh.configs.deploy import MAX_REPLICAS, DeployConfig
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.pipeline import PipelineError, PipelineSpec, get_pipeline
from omni_mesh.configs.settings import LogLevel
from omni_mesh.sidecar.supervisor import Supervisor, SupervisorError, free_port, port_in_use

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
MIN_SECRET_CHARS = 16
SECRET_ENV = "OMNI_SECRET"


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
    stop_timeout_s: float
    log_level: LogLevel

    @property
    def replica_spec(self) -> str:
        return ":".join(str(n) for n in self.replicas)


@dataclass(frozen=True)
class Planned:
    """One process to start: its name, command line and where it answers."""

    name: str
    argv: tuple[str, ...]
    url: str
    label: str  # shown in the endpoint list
    health_path: str = "/health"

    @property
    def ready_url(self) -> str:
        return f"{_probe_url(self.url)}{self.health_path}"


# ---- flags -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-up",
        description="Run a whole pipeline on this machine: control plane, every stage replica "
        "and an API server, until Ctrl-C.",
    )
    p.add_argument("--pipeline", required=True, help="registered pipeline name")
    p.add_argument(
        "--replicas", help="replicas per stage, e.g. 1:2:1 (default: the deploy config's)"
    )
    p.add_argument("--port", type=_port, default=8000, help="API server port (default 8000)")
    p.add_argument("--host", default=LOCALHOST, help="API server interface (default 127.0.0.1)")
    p.add_argument(
        "--deploy-config", type=Path, help="deploy YAML for every stage (default: bundled)"
    )
    p.add_argument("--secret", help=f"deployment secret (default: ${SECRET_ENV}, else generated)")
    p.add_argument("--cp-port", type=_port, help="control plane port (default: a free one)")
    p.add_argument("--stage-overrides", help='per-stage JSON, e.g. \'{"1": {"max_num_seqs": 4}}\'')
    p.add_argument("--keep-logs", action="store_true", help="keep the process logs on exit")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds per start phase")
    p.add_argument("--stop-timeout", type=float, default=10.0, help="grace before SIGKILL")
    p.add_argument("--log-level", type=LogLevel, default=LogLevel.INFO, help="log level")
    return p


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str]) -> UpConfig:
    """Parse and validate; a bad flag exits 2 with a message naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        pipeline = get_pipeline(args.pipeline)
        deploy_path = None if args.deploy_config is None else args.deploy_config.resolve()
        if deploy_path is not None and not deploy_path.is_file():
            raise ValueError(f"--deploy-config: no such file: {deploy_path}")
        # Fail here, once, rather than in every stage process.
        deploy = load_deploy_config(deploy_path, pipeline, stage_overrides=args.stage_overrides)
        replicas = parse_replicas(args.replicas, pipeline, deploy)
        secret, source = resolve_secret(args.secret, env)
        if args.ready_timeout <= 0 or args.stop_timeout < 0:
            raise ValueError("--ready-timeout must be positive and --stop-timeout not negative")
        if args.cp_port is not None and args.cp_port == args.port:
            raise ValueError(f"--cp-port and --port are both {args.port}")
    except (PipelineError, ValueError) as exc:
        parser.error(str(exc))
    return UpConfig(
        pipeline=pipeline,
        replicas=replicas,
        host=args.host,
        port=args.port,
        cp_port=args.cp_port,
        deploy_config=deploy_path,
        stage_overrides=args.stage_overrides,
        secret=secret,
        secret_source=source,
        keep_logs=args.keep_logs,
        ready_timeout_s=args.ready_timeout,
        stop_timeout_s=args.stop_timeout,
        log_level=args.log_level,
    )


def parse_replicas(
    spec: str | None, pipeline: PipelineSpec, deploy: DeployConfig | None = None
) -> tuple[int, ...]:
    """``1:2:1`` → (1, 2, 1): one positive count per stage, in stage id order. Without a
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
        text = count.strip()
        if not text.isdigit() or not 1 <= int(text) <= MAX_REPLICAS:
            raise ValueError(
                f"--replicas: the count for stage {stage_id} ({pipeline.stage(stage_id).name}) "
                f"must be an integer from 1 to {MAX_REPLICAS}, got {count!r}"
            )
        out.append(int(text))
    return tuple(out)


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


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return int(text)


# ---- the processes -----------------------------------------------------------------------------


def plan_control_plane(port: int, log_level: LogLevel = LogLevel.INFO) -> Planned:
    argv = (sys.executable, "-m", "omni_mesh.control_plane", "serve")
    flags = ("--host", LOCALHOST, "--port", str(port), "--log-level", log_level.value)
    return Planned(
        "control-plane", (*argv, *flags), _url(LOCALHOST, port), "control plane", "/healthz"
    )


def plan_stages(config: UpConfig, cp_url: str) -> list[Planned]:
    """Every replica of every stage (headless, free ports), then the API server."""
    common = ["--pipeline", config.pipeline.name, "--control-plane", cp_url]
    common += ["--log-level", config.log_level.value]
    if config.deploy_config is not None:
        common += ["--deploy-config", str(config.deploy_config)]
    if config.stage_overrides is not None:
        common += ["--stage-overrides", config.stage_overrides]
    stage_cmd = (sys.executable, "-m", "omni_mesh.sidecar.cli_stage", *common)
    plans = []
    for stage_id, count in zip(sorted(config.pipeline.stage_ids), config.replicas, strict=True):
        name = config.pipeline.stage(stage_id).name
        for replica in range(count):
            port = free_port(LOCALHOST)
            argv = ("--stage-id", str(stage_id), "--headless", "--host", LOCALHOST)
            plans.append(
                Planned(
                    f"stage{stage_id}-{name}-{replica}",
                    (*stage_cmd, *argv, "--port", str(port)),
                    _url(LOCALHOST, port),
                    f"stage {stage_id} {name} #{replica}",
                )
            )
    entry = str(config.pipeline.entry_stage_id)
    api = ("--stage-id", entry, "--api-only", "--host", config.host, "--port", str(config.port))
    url = _url(config.host, config.port)
    plans.append(Planned("api-server", (*stage_cmd, *api), url, "API server"))
    return plans


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _probe_url(url: str) -> str:
    """Where to check a server that listens on every interface."""
    for wildcard in ("http://0.0.0.0:", "http://[::]:"):
        if url.startswith(wildcard):
            return f"http://{LOCALHOST}:{url.removeprefix(wildcard)}"
    return url


# ---- running -----------------------------------------------------------------------------------


def run(config: UpConfig, env: Mapping[str, str]) -> int:
    """Start everything, wait for a signal or a death, stop everything; the exit code."""
    listens = [(config.host, config.port, "--port")]
    if config.cp_port is not None:
        listens.append((LOCALHOST, config.cp_port, "--cp-port"))
    for host, port, flag in listens:
        if port_in_use(host, port):
            print(f"omni-up: cannot listen on {host}:{port} ({flag}): in use", file=sys.stderr)
            return 1
    stop = threading.Event()
    _handle_signals(stop)
    sup = Supervisor(
        keep_logs=config.keep_logs, grace_s=config.stop_timeout_s, log_prefix="omni-up-"
    )
    child_env = {**env, SECRET_ENV: config.secret, "PYTHONUNBUFFERED": "1"}
    try:
        cp_port = config.cp_port or free_port(LOCALHOST)
        plans = [plan_control_plane(cp_port, config.log_level)]
        if not _start(sup, plans, child_env, config.ready_timeout_s, stop):
            return 0
        plans += plan_stages(config, plans[0].url)
        if not _start(sup, plans[1:], child_env, config.ready_timeout_s, stop):
            return 0
        _print_endpoints(config, plans, sup)
        sup.wait(stop)
        return 0
    except SupervisorError as exc:
        sup.keep_logs = True
        print(f"omni-up: {exc}", file=sys.stderr)
        print(f"omni-up: stopping everything; logs kept in {sup.log_dir}", file=sys.stderr)
        return 1
    finally:
        logger.info("stopping %d processes", len(sup.children))
        sup.close()


def _start(
    sup: Supervisor,
    plans: Sequence[Planned],
    env: Mapping[str, str],
    timeout_s: float,
    stop: threading.Event,
) -> bool:
    """Start ``plans`` and wait until each answers; False when a signal came first."""
    children = [sup.start(p.name, p.argv, env=env, ready_url=p.ready_url) for p in plans]
    return sup.wait_ready(children, timeout_s=timeout_s, cancel=stop)


def _print_endpoints(config: UpConfig, plans: Sequence[Planned], sup: Supervisor) -> None:
    width = max(len(p.label) for p in plans)
    for p in plans:
        print(f"  {p.label:<{width}}  {p.url}")
    kept = "kept" if config.keep_logs else "removed on exit; --keep-logs keeps them"
    print(f"  {'secret':<{width}}  {config.secret_source} (stages get it as ${SECRET_ENV})")
    print(f"  {'logs':<{width}}  {sup.log_dir} ({kept})")
    print(
        f"omni-up ready: {_url(config.host, config.port)} "
        f"(pipeline {config.pipeline.name}, replicas {config.replica_spec})",
        flush=True,
    )


def _handle_signals(stop: threading.Event) -> None:
    """First SIGINT/SIGTERM: stop gracefully. A second one: stop now (KeyboardInterrupt)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        logger.info("got %s; stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv, os.environ)
    logging.basicConfig(
        level=config.log_level.as_int, format="%(asctime)s omni-up %(levelname)s %(message)s"
    )
    try:
        return run(config, os.environ)
    except KeyboardInterrupt:
        print("omni-up: interrupted; processes killed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
