"""``omni-cp``: ``serve`` the control plane, or show its ``status``. Parses, configures, delegates.

Every ``serve`` flag may also come from the environment (``OMNI_CP_<FLAG>``, e.g.
``OMNI_CP_LEASE_TTL_MS``); a flag given on the command line wins. Bad flags exit with 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn
from urllib.parse import urlsplit

from pydantic import ValidationError

from omni_mesh.configs.pipeline_spec import PipelineError
from omni_mesh.configs.registry import load_pipeline_modules, pipeline_modules_from
from omni_mesh.configs.settings import ControlPlaneClientSettings, ControlPlaneSettings, LogLevel
from omni_mesh.configs.settings_flags import (
    add_pipeline_module_flag,
    add_setting_flags,
    flag_specs,
    settings_error_text,
)
from omni_mesh.control_plane.client import ControlPlaneClient, SessionNotFound, SessionsClient
from omni_mesh.control_plane.embedded_redis import EmbeddedRedisError
from omni_mesh.control_plane.errors import ControlPlaneError, ControlPlaneUnavailableError
from omni_mesh.control_plane.redis_conn import RedisUrlError, check_url, redact
from omni_mesh.control_plane.server import ServeError, ServingInfo, serve_forever
from omni_mesh.control_plane.status import render_sessions, render_status

#: ``omni-cp serve``'s flags: one per setting, each also read from ``OMNI_CP_<FIELD>``.
SERVE_FLAGS = flag_specs(ControlPlaneSettings)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``omni-cp`` parser and its subcommand parsers by name."""
    parser = argparse.ArgumentParser(
        prog="omni-cp", description="omni-mesh control plane: registry, leases, discovery."
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve,status}")
    serve = sub.add_parser("serve", help="run the control plane HTTP API")
    add_setting_flags(serve, ControlPlaneSettings, SERVE_FLAGS)
    add_pipeline_module_flag(serve)
    status = sub.add_parser("status", help="show every registered instance")
    status.add_argument("--cp", default=argparse.SUPPRESS, help="omni-cp URL(s), comma-separated")
    status.add_argument(
        "--auth-token", default=argparse.SUPPRESS, help="bearer token (or OMNI_CP_AUTH_TOKEN)"
    )
    status.add_argument("--timeout-s", type=float, default=argparse.SUPPRESS, help="per request")
    status.add_argument("--pipeline", default=None, help="only this pipeline")
    return parser, {"serve": serve, "status": status}


def _settings_error(parser: argparse.ArgumentParser, exc: ValidationError, prefix: str) -> NoReturn:
    problems = []
    for err in exc.errors(include_url=False, include_input=False):
        field = ".".join(str(p) for p in err["loc"])
        where = f"--{field.replace('_', '-')} / {prefix}{field.upper()}: " if field else ""
        problems.append(f"{where}{err['msg']}")
    parser.error("; ".join(problems))


def _configure_logging(level: LogLevel) -> None:
    logging.basicConfig(
        level=level.as_int,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _announce(info: ServingInfo) -> None:
    kind = "embedded" if info.embedded_redis else "external"
    print(f"omni-cp serving on {info.url} (redis {redact(info.redis_url)} {kind})", flush=True)


def cmd_serve(parser: argparse.ArgumentParser, args: dict[str, Any]) -> int:
    try:  # the control plane checks stage ids against the pipelines: it imports users' too
        load_pipeline_modules(pipeline_modules_from(args.pop("pipeline_module", None), os.environ))
    except PipelineError as exc:
        parser.error(str(exc))
    try:
        settings = ControlPlaneSettings(**args)
    except ValidationError as exc:
        parser.error(settings_error_text(exc, ControlPlaneSettings, SERVE_FLAGS))
    if settings.redis_url_str is not None:
        try:
            check_url(settings.redis_url_str)
        except RedisUrlError as exc:
            parser.error(f"--redis-url / OMNI_CP_REDIS_URL: {exc}")
    _configure_logging(settings.log_level)
    try:
        serve_forever(settings, on_ready=_announce)
    except RedisUrlError as exc:  # found at start-up: the Redis there is a Cluster node
        print(f"omni-cp: error: {exc}", file=sys.stderr)
        return 2
    except (ServeError, EmbeddedRedisError) as exc:
        print(f"omni-cp: error: {exc}", file=sys.stderr)
        return 1
    return 0


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an omni-cp base URL (``http(s)://HOST[:PORT]``), or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # a bad port raises here
    except ValueError as exc:
        return f"{exc} (expected http://HOST:PORT)"
    if parts.scheme not in ("http", "https"):
        return "expected http://HOST:PORT or https://HOST:PORT"
    if not parts.hostname or any(c.isspace() for c in parts.hostname):
        return "no host (expected http://HOST:PORT)"
    if parts.query or parts.fragment or parts.username is not None:
        return "expected a base URL without credentials, query or fragment"
    return None


async def _fetch_status(settings: ControlPlaneClientSettings, pipeline: str | None) -> str:
    async with ControlPlaneClient(
        settings.urls, auth_token=settings.token, timeout_s=settings.timeout_s
    ) as client:
        table = render_status(await client.pipelines(), pipeline=pipeline)
        try:
            sessions = render_sessions(await SessionsClient(client).counts(), pipeline=pipeline)
        except SessionNotFound:  # an omni-cp from before sessions
            sessions = ""
        return f"{table}\n\n{sessions}" if sessions else table


def cmd_status(parser: argparse.ArgumentParser, args: dict[str, Any]) -> int:
    pipeline = args.pop("pipeline", None)
    if "cp" in args:
        args["url"] = args.pop("cp")
    try:
        settings = ControlPlaneClientSettings(**args)
    except ValidationError as exc:
        _settings_error(parser, exc, "OMNI_CP_")
    if not settings.urls:
        parser.error("--cp: no control-plane URL given")
    for url in settings.urls:
        problem = url_problem(url)
        if problem is not None:
            parser.error(f"--cp / OMNI_CP_URL: invalid control-plane URL {url!r}: {problem}")
    _configure_logging(LogLevel.WARNING)
    try:
        table = asyncio.run(_fetch_status(settings, pipeline))
    except ControlPlaneUnavailableError as exc:
        print(f"omni-cp status: {exc.describe()}", file=sys.stderr)
        return 1
    except ControlPlaneError as exc:
        print(f"omni-cp status: {exc}", file=sys.stderr)
        return 1
    print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = build_parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command", None)
    if command == "serve":
        return cmd_serve(commands["serve"], args)
    if command == "status":
        return cmd_status(commands["status"], args)
    parser.print_help(sys.stderr)
    return 2
