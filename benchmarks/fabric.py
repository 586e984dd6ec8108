"""Starting and stopping real omni-mesh processes for benchmarks.

:class:`Fabric` starts ``omni-cp serve`` (with its embedded redis-server), stage pods
(``python -m omni_mesh.sidecar.cli_stage``: a sidecar and its engine process) and API servers,
on free loopback ports, each in its own process group. :meth:`Fabric.close` stops them all
(SIGTERM, then SIGKILL); :func:`kill_everything` is the last resort that ``__main__`` runs on
any exit, Ctrl-C included. Nothing is left behind: processes, ports or ``/dev/shm`` segments.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.measure import ProcessSet, children, cmdline
from tests.procs import LOCALHOST, ManagedProcess, clean_env, free_port, wait_until

SECRET = "benchmark-secret-0123456789abcdef"
PIPELINE = "synthetic"
ENGINE_MODULE = "omni_mesh.engines"


def http_json(url: str, *, method: str = "GET", body: Any = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Pod:
    """One stage pod (or API server) that a benchmark started."""

    proc: ManagedProcess
    stage_id: int
    url: str
    role: str  # "stage" | "api"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def engine_pid(self) -> int | None:
        for pid in children(self.proc.pid):
            if ENGINE_MODULE in cmdline(pid):
                return pid
        return None


class Fabric:
    """A control plane and any number of stage pods of one pipeline, on loopback."""

    def __init__(
        self,
        name: str,
        *,
        pipeline: str = PIPELINE,
        deploy_config: Path | None = None,
        stage_overrides: dict[str, dict[str, Any]] | None = None,
        stage_args: Sequence[str] = (),
        cp_args: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.pipeline = pipeline
        self.deploy_config = deploy_config
        self.stage_overrides = stage_overrides
        self.stage_args = list(stage_args)
        self.cp_args = list(cp_args)
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"omni-bench-{name}-"))
        self.cp: ManagedProcess | None = None
        self.cp_url = ""
        self.pods: list[Pod] = []
        self.failed = False

    # ---- lifecycle -----------------------------------------------------------------------

    def start_cp(self, timeout: float = 30.0) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "omni_mesh.control_plane", "serve"]
        argv += ["--host", LOCALHOST, "--port", str(port), *self.cp_args]
        self.cp = ManagedProcess(
            argv, name=f"omni-cp-{port}", env=clean_env(), log_dir=self.log_dir
        ).start()
        self.cp_url = f"http://{LOCALHOST}:{port}"
        self.cp.wait_for_output(r"omni-cp serving on ", timeout)
        self.cp.wait_http_ready(self.cp_url + "/healthz", timeout)
        return self.cp_url

    def add_stage(
        self,
        stage_id: int,
        *,
        extra: Sequence[str] = (),
        wait: bool = True,
        api_only: bool = False,
        serve_api: bool = False,
        deploy_config: Path | None = None,
        stage_overrides: dict[str, dict[str, Any]] | None = None,
    ) -> Pod:
        assert self.cp is not None, "start_cp() first"
        port = free_port()
        argv = [
            sys.executable, "-m", "omni_mesh.sidecar.cli_stage",
            "--pipeline", self.pipeline,
            "--stage-id", str(stage_id),
            "--control-plane", self.cp_url,
            "--host", LOCALHOST,
            "--port", str(port),
            "--secret", SECRET,
        ]  # fmt: skip
        if api_only:
            argv.append("--api-only")
        elif not serve_api:
            argv.append("--headless")
        config = deploy_config or self.deploy_config
        if config is not None:
            argv += ["--deploy-config", str(config)]
        overrides = stage_overrides if stage_overrides is not None else self.stage_overrides
        if overrides:
            argv += ["--stage-overrides", json.dumps(overrides)]
        argv += [*self.stage_args, *extra]
        role = "api" if api_only else "stage"
        n = sum(1 for p in self.pods if p.stage_id == stage_id and p.role == role)
        name = f"api-{n}" if api_only else f"s{stage_id}-{n}"
        proc = ManagedProcess(argv, name=name, env=clean_env(), log_dir=self.log_dir).start()
        pod = Pod(proc, stage_id, f"http://{LOCALHOST}:{port}", role)
        self.pods.append(pod)
        if wait:
            self.wait_ready([pod])
        return pod

    def wait_ready(self, pods: Sequence[Pod] | None = None, timeout: float = 120.0) -> None:
        for pod in pods if pods is not None else self.pods:
            pod.proc.wait_http_ready(pod.url + "/health", timeout)

    def restart(self, pod: Pod) -> Pod:
        """Start a replacement of ``pod`` (same stage and role, new port)."""
        return self.add_stage(pod.stage_id, api_only=pod.role == "api")

    def close(self) -> None:
        """Stop API servers, then stages, then the control plane (drain, then kill)."""
        order = sorted(self.pods, key=lambda p: (p.role != "api", p.stage_id))
        for pod in order:
            if pod.proc.alive:
                pod.proc.send_signal(15)
        for pod in order:
            pod.proc.terminate(timeout=20)
        if self.cp is not None:
            self.cp.terminate(timeout=10)
        if not self.failed:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.failed = True
            print(f"[{self.name}] failed; process logs kept in {self.log_dir}", file=sys.stderr)
        self.close()

    # ---- queries -------------------------------------------------------------------------

    def stage_pods(self, stage_id: int) -> list[Pod]:
        return [p for p in self.pods if p.stage_id == stage_id and p.role == "stage"]

    def discovered(self, stage_id: int) -> list[str]:
        url = f"{self.cp_url}/v1/pipelines/{self.pipeline}/stages/{stage_id}/instances"
        return [i["address"] for i in http_json(url)["instances"]]

    def wait_discovered(self, stage_id: int, count: int, timeout: float = 30.0) -> None:
        wait_until(
            lambda: len(self.discovered(stage_id)) == count,
            timeout,
            message=lambda: f"stage {stage_id} pool: {self.discovered(stage_id)}",
        )

    def processes(self) -> ProcessSet:
        """Every process by kind: sidecar, engine, API server, omni-cp, redis-server."""
        ps = ProcessSet()
        for pod in self.pods:
            if not pod.proc.alive:
                continue
            if pod.role == "api":
                ps.add("API server (sidecar, --api-only)", pod.pid)
                continue
            ps.add("sidecar", pod.pid)
            engine = pod.engine_pid()
            if engine is not None:
                ps.add("engine", engine)
        if self.cp is not None and self.cp.alive:
            ps.add("omni-cp", self.cp.pid)
            for child in children(self.cp.pid):
                if "redis-server" in cmdline(child):
                    ps.add("redis-server", child)
        return ps

    def metric(self, url: str, name: str, **labels: str) -> float:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def kill_everything() -> None:
    """Kill every process any benchmark started and has not stopped yet (by pid)."""
    ManagedProcess.kill_all()


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("omni-*")}


def settle(seconds: float) -> None:
    time.sleep(seconds)
