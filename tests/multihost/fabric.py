"""A synthetic 1:2:1 deployment spread over four test hosts (see :mod:`tests.multihost.hosts`):

- ``cp``: ``omni-cp`` with its embedded Redis;
- ``a``: an API server (``--api-only``) and the stage-0 replica;
- ``b``: a stage-1 replica;
- ``c``: a stage-1 replica and the stage-2 replica.

Every pod listens on its host's address, advertises it (``--advertise-address``) and names its
host (``--host-id``), so a hand-off between two hosts goes over HTTP and one inside host ``c``
(stage 1 -> stage 2) over shared memory. Stage 0 outputs 16 MiB (A -> B/C over HTTP), stage 1
1 MiB (B -> C over HTTP, C -> C as an shm handle).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.multihost.hosts import Host, TestHosts
from tests.procs import ManagedProcess, stop_together, wait_until

SECRET = "multihost-test-secret-0123456789"
PIPELINE = "synthetic"
CP_PORT = 7700
S0_BYTES = 16 * 1024 * 1024
S1_BYTES = 1024 * 1024
#: How long the pods (then omni-cp) have to exit after SIGTERM when the fabric closes.
STOP_S = 15.0
OVERRIDES = json.dumps({"0": {"output_bytes": S0_BYTES}, "1": {"output_bytes": S1_BYTES}})


def http(url: str, body: object | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    """GET (or POST JSON); (status, body), status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, repr(exc).encode()


class Pod:
    """One ``omni-stage`` process on a test host."""

    def __init__(self, host: Host, stage_id: int, port: int, proc: ManagedProcess) -> None:
        self.host = host
        self.stage_id = stage_id
        self.url = f"http://{host.address}:{port}"
        self.proc = proc

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels`` (read from its host)."""
        return scrape(self.host, self.url, name, **labels)


def scrape(host: Host, url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` at ``url``/metrics whose labels include ``labels``."""
    status, body = host.run(lambda: http(url + "/metrics", timeout=5))
    assert status == 200, body[:200]
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


class Fabric:
    """The deployment; :meth:`close` stops it and removes the hosts."""

    def __init__(self, log_dir: Path) -> None:
        self.hosts = TestHosts(["cp", "a", "b", "c"], log_dir)
        cp = self.hosts["cp"]
        self.cp_url = f"http://{cp.address}:{CP_PORT}"
        self.pods: dict[str, Pod] = {}
        try:
            self.cp = cp.spawn(
                [sys.executable, "-m", "omni_mesh.control_plane", "serve",
                 "--host", cp.address, "--port", str(CP_PORT)],
                name="omni-cp",
            )  # fmt: skip
            self.cp.wait_for_output(r"omni-cp serving on ", 30)
            self._pod("api", "a", 0, 8000, "--api-only")
            self._pod("s0", "a", 0, 9000, "--headless")
            self._pod("s1b", "b", 1, 9000, "--headless")
            self._pod("s1c", "c", 1, 9000, "--headless")
            self._pod("s2", "c", 2, 9001, "--headless")
            for pod in self.pods.values():
                wait_until(
                    lambda p=pod: p.host.run(lambda: http(p.url + "/health", timeout=2))[0] == 200,  # type: ignore[misc]
                    120,
                    interval=0.3,
                    message=lambda p=pod: p.proc.describe(),  # type: ignore[misc]
                )
            wait_until(lambda: len(self.pool(1)) == 2 and len(self.pool(2)) == 1, 30)
        except BaseException:
            self.close()
            raise

    def _pod(self, name: str, host_name: str, stage_id: int, port: int, *flags: str) -> None:
        host = self.hosts[host_name]
        proc = host.spawn(
            [
                sys.executable, "-m", "omni_mesh.sidecar.cli_stage",
                "--pipeline", PIPELINE,
                "--stage-id", str(stage_id),
                "--control-plane", self.cp_url,
                "--host", host.address,
                "--port", str(port),
                "--advertise-address", f"http://{host.address}:{port}",
                "--host-id", host_name,
                "--secret", SECRET,
                "--stage-overrides", OVERRIDES,
                *flags,
            ],
            name=name,
        )  # fmt: skip
        self.pods[name] = Pod(host, stage_id, port, proc)

    def pool(self, stage_id: int) -> list[str]:
        """Addresses omni-cp serves for ``stage_id`` (healthy only)."""
        url = f"{self.cp_url}/v1/pipelines/{PIPELINE}/stages/{stage_id}/instances"
        status, body = self.hosts["a"].run(lambda: http(url, timeout=5))
        if status != 200:
            return []
        return [str(i["address"]) for i in json.loads(body)["instances"]]

    def cp_metric(self, name: str, **labels: str) -> float:
        """Sum of the control plane's samples of ``name`` whose labels include ``labels``."""
        return scrape(self.hosts["a"], self.cp_url, name, **labels)

    @property
    def api_url(self) -> str:
        return self.pods["api"].url

    def close(self) -> None:
        """Stop the pods together (each drains on its own), then omni-cp, then the hosts."""
        stop_together([pod.proc for pod in self.pods.values()], STOP_S)
        if hasattr(self, "cp"):
            stop_together([self.cp], STOP_S)
        self.hosts.close()


class Load:
    """Client threads on a host posting ``/v1/generate`` in a closed loop (a little bounded
    load); every status and failure is recorded."""

    def __init__(self, fabric: Fabric, host: Host, workers: int = 2, timeout: float = 30.0) -> None:
        self.url = fabric.api_url + "/v1/generate"
        self.host = host
        self.timeout = timeout
        self.statuses: list[int] = []
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(n,), daemon=True) for n in range(workers)
        ]

    def _loop(self, worker: int) -> None:
        with self.host.enter():
            n = 0
            while not self._stop.is_set():
                n += 1
                t0 = time.monotonic()
                status, body = http(self.url, {"prompt": f"w{worker}-{n}"}, timeout=self.timeout)
                self.latencies.append(time.monotonic() - t0)
                self.statuses.append(status)
                if status != 200:
                    self.failures.append(f"{status} {body[:300].decode(errors='replace')}")

    def wait_ok(self, count: int, timeout: float = 60.0) -> None:
        """Wait until ``count`` more requests succeeded."""
        target = self.statuses.count(200) + count
        wait_until(
            lambda: self.statuses.count(200) >= target,
            timeout,
            message=lambda: f"{self.statuses.count(200)}/{target} ok; {self.failures[-3:]}",
        )

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout + 10)
