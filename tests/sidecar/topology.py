"""A real multi-stage topology on loopback for integration tests: omni-cp with its embedded
Redis, every replica of every stage as an ``omni-stage`` process, and an ``--api-only`` API
server. Everything is stopped by :meth:`Topology.close`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.procs import (
    LOCALHOST,
    ControlPlaneProcess,
    ManagedProcess,
    clean_env,
    free_port,
    orphaned_shm_segments,
    start_control_plane,
    stop_together,
    wait_until,
)

SECRET = "integration-test-secret-0123456789"
SHM_DIR = Path("/dev/shm")


def shm_segments() -> set[str]:
    """Leaked segments (see :func:`tests.procs.orphaned_shm_segments`)."""
    return orphaned_shm_segments()


class Topology:
    def __init__(
        self,
        pipeline: str,
        replicas: Sequence[int],
        log_dir: Path,
        *,
        extra_stage_args: Sequence[str] = (),
        api: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.replicas = list(replicas)
        self.log_dir = log_dir
        self.extra = list(extra_stage_args)
        self.cp: ControlPlaneProcess | None = None
        self.stages: dict[int, list[ManagedProcess]] = {}
        self.urls: dict[int, list[str]] = {}
        self.api: ManagedProcess | None = None
        self.api_url = ""
        self.with_api = api

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, *, stages: Sequence[int] | None = None) -> Topology:
        self.cp = start_control_plane(None, log_dir=self.log_dir, name=f"cp-{self.pipeline}")
        for stage_id in stages if stages is not None else range(len(self.replicas)):
            for _ in range(self.replicas[stage_id]):
                self.add_replica(stage_id, wait=False)
        if self.with_api:
            self.start_api()
        for stage_id, procs in self.stages.items():
            for proc, url in zip(procs, self.urls[stage_id], strict=True):
                proc.wait_http_ready(url + "/health", timeout=90)
        if self.api is not None:
            self.api.wait_http_ready(self.api_url + "/health", timeout=60)
        return self

    def _stage_argv(self, stage_id: int, port: int, *flags: str) -> list[str]:
        assert self.cp is not None
        return [
            sys.executable, "-m", "omni_mesh.sidecar.cli_stage",
            "--pipeline", self.pipeline,
            "--stage-id", str(stage_id),
            "--control-plane", self.cp.url,
            "--host", LOCALHOST,
            "--port", str(port),
            "--secret", SECRET,
            *flags,
            *self.extra,
        ]  # fmt: skip

    def add_replica(self, stage_id: int, *, wait: bool = True) -> tuple[ManagedProcess, str]:
        port = free_port()
        n = len(self.stages.get(stage_id, []))
        proc = ManagedProcess(
            self._stage_argv(stage_id, port, "--headless"),
            name=f"{self.pipeline}-s{stage_id}-{n}",
            env=clean_env(),
            log_dir=self.log_dir,
        ).start()
        url = f"http://{LOCALHOST}:{port}"
        self.stages.setdefault(stage_id, []).append(proc)
        self.urls.setdefault(stage_id, []).append(url)
        if wait:
            proc.wait_http_ready(url + "/health", timeout=90)
        return proc, url

    def start_api(self) -> None:
        port = free_port()
        self.api = ManagedProcess(
            self._stage_argv(0, port, "--api-only"),
            name=f"{self.pipeline}-api",
            env=clean_env(),
            log_dir=self.log_dir,
        ).start()
        self.api_url = f"http://{LOCALHOST}:{port}"

    def close(self) -> None:
        """Stop the pods and the API server together (each drains on its own), then omni-cp."""
        procs = [p for ps in self.stages.values() for p in ps]
        if self.api is not None:
            procs.append(self.api)
        stop_together(procs, timeout=20)
        if self.cp is not None:
            self.cp.proc.terminate(timeout=10)

    # ---- queries -------------------------------------------------------------------------

    def discovered(self, stage_id: int) -> list[str]:
        assert self.cp is not None
        url = f"{self.cp.url}/v1/pipelines/{self.pipeline}/stages/{stage_id}/instances"
        return [i["address"] for i in json.loads(http_get(url))["instances"]]

    def wait_discovered(self, stage_id: int, count: int, timeout: float = 10.0) -> None:
        wait_until(
            lambda: len(self.discovered(stage_id)) == count,
            timeout,
            message=lambda: f"stage {stage_id} pool: {self.discovered(stage_id)}",
        )

    def metric(self, url: str, name: str, **labels: str) -> float:
        """Sum of a metric's samples on one instance whose labels include ``labels``."""
        text = http_get(url + "/metrics").decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def http_get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
    return body


def post_json(
    url: str, body: object, timeout: float = 60.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def engine_pid(stage_proc: ManagedProcess) -> int:
    """The pid of a stage pod's engine process (its only python child)."""
    children = Path(f"/proc/{stage_proc.pid}/task/{stage_proc.pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"omni_mesh.engines" in cmdline:
            return int(pid)
    raise AssertionError(f"no engine child of {stage_proc.name}")


def kill_a_busy_engine(topo: Topology, stage_id: int, timeout: float = 60.0) -> int:
    """kill -9 the engine of the first replica of ``stage_id`` seen with a request in flight
    (polled every 10 ms); its pid."""
    replicas = list(zip(topo.stages[stage_id], topo.urls[stage_id], strict=True))
    victim: list[int] = []

    def busy() -> bool:
        for proc, url in replicas:
            if topo.metric(url, "omni_stage_in_flight") >= 1:
                victim.append(engine_pid(proc))
                return True
        return False

    wait_until(busy, timeout, interval=0.01)
    os.kill(victim[0], signal.SIGKILL)
    return victim[0]


@contextlib.contextmanager
def held_engines(topo: Topology, stage_id: int) -> Iterator[list[int]]:
    """The engine process of every replica of ``stage_id`` stopped (SIGSTOP) inside the block,
    continued (SIGCONT) when it ends, on failure too; their pids. The pods' sidecars keep
    serving (accepting hops, answering /health): what reaches the stage waits in its engines,
    so it is still there for whatever the block does to it, however busy the machine is."""
    pids = [engine_pid(proc) for proc in topo.stages[stage_id]]
    stopped: list[int] = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        yield pids
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def run_in_slices(
    pids: Sequence[int], until: Callable[[], object], timeout: float, slice_s: float = 0.001
) -> None:
    """Let the held processes ``pids`` (:func:`held_engines`) run for ``slice_s`` at a time
    until ``until()``, checked while they are stopped, holds (they are stopped on return); an
    AssertionError after ``timeout`` s. The calling thread runs at real-time priority meanwhile
    (SCHED_FIFO, where allowed: root): on a busy machine it woke from a slice tens of
    milliseconds late, and vLLM's tiny thinker had made a hundred tokens by then."""
    with _real_time():
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"not reached in {timeout}s of slices"
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            time.sleep(slice_s)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)


@contextlib.contextmanager
def _real_time() -> Iterator[None]:
    """The calling thread under SCHED_FIFO inside the block, where the system allows it."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def answers_while_killing(
    topo: Topology, stage_id: int, call: Callable[[int], Any], seeds: Sequence[int]
) -> dict[int, Any]:
    """``call(seed)`` from a thread per seed while the engine of a replica of ``stage_id`` is
    killed with -9 mid-request (:func:`kill_a_busy_engine`); each seed's answer, or the
    exception its call raised."""
    results: dict[int, Any] = {}

    def run(seed: int) -> None:
        try:
            results[seed] = call(seed)
        except Exception as exc:  # the caller's assertions report it
            results[seed] = exc

    threads = [threading.Thread(target=run, args=(seed,)) for seed in seeds]
    for t in threads:
        t.start()
    kill_a_busy_engine(topo, stage_id)
    for t in threads:
        t.join(180)
    return results


def engine_tmp(pid: int) -> Path:
    """The temp folder the sidecar gave engine ``pid`` ($TMPDIR in its environment)."""
    env = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        if "=" in item
    )
    tmp = Path(env["TMPDIR"])
    assert tmp.is_dir() and tmp.name.startswith("omni-engine-s"), tmp
    return tmp


def wait_gone(pid: int, timeout: float) -> float:
    t0 = time.monotonic()
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), timeout)
    return time.monotonic() - t0


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (OSError, IndexError):
        return True
