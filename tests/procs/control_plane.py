"""A real ``omni-cp serve`` for tests."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from omni_mesh.launcher.planned import LOCALHOST
from omni_mesh.procutil import free_port
from tests.procs.managed import ManagedProcess
from tests.procs.polling import clean_env

# ---- omni-cp ------------------------------------------------------------------------------


def cp_argv(*args: str) -> list[str]:
    """``omni-cp`` as ``python -m omni_mesh.control_plane`` with this interpreter."""
    return [sys.executable, "-m", "omni_mesh.control_plane", *args]


@dataclass
class ControlPlaneProcess:
    """A running ``omni-cp serve``."""

    proc: ManagedProcess
    host: str
    port: int
    auth_token: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else {}

    def terminate(self, timeout: float = 10.0) -> int:
        return self.proc.terminate(timeout)

    def kill(self) -> int:
        return self.proc.kill()


def start_control_plane(
    redis_url: str | None,
    *,
    port: int | None = None,
    auth_token: str | None = None,
    heartbeat_interval_ms: int | None = None,
    lease_ttl_ms: int | None = None,
    sweep_interval_ms: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_dir: str | Path | None = None,
    name: str | None = None,
    ready_timeout: float = 30.0,
) -> ControlPlaneProcess:
    """Start ``omni-cp serve`` on a free port and wait until /healthz answers 200.

    ``redis_url=None`` lets omni-cp start its embedded Redis. The environment is the test's
    minus ``OMNI_*`` plus ``env``.
    """
    port = port or free_port()
    args = ["serve", "--host", LOCALHOST, "--port", str(port), "--log-level", "DEBUG"]
    optional: dict[str, object | None] = {
        "--redis-url": redis_url,
        "--auth-token": auth_token,
        "--heartbeat-interval-ms": heartbeat_interval_ms,
        "--lease-ttl-ms": lease_ttl_ms,
        "--sweep-interval-ms": sweep_interval_ms,
    }
    for flag, value in optional.items():
        if value is not None:
            args += [flag, str(value)]
    proc = ManagedProcess(
        cp_argv(*args, *extra_args),
        name=name or f"omni-cp-{port}",
        env=clean_env(env),
        log_dir=log_dir,
    ).start()
    cp = ControlPlaneProcess(proc, LOCALHOST, port, auth_token)
    try:
        proc.wait_for_output(r"omni-cp serving on ", ready_timeout)
        proc.wait_http_ready(f"{cp.url}/healthz", ready_timeout)
    except BaseException:
        proc.cleanup()
        raise
    return cp
