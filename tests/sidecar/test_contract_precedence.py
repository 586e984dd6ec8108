"""One precedence, walked with real omni-stage processes: for stage 1's ``max_inflight`` (the
capacity a pod registers) each pod adds one more layer — defaults < base YAML < overlay <
platform section < OMNI_STAGE_MAX_INFLIGHT < --max-inflight < --stage-overrides — and the
control plane sees the top layer's value. The pods' ports show OMNI_STAGE_PORT at work (a pod
given no --port listens where the variable says) and a flag beating it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.procs import (
    LOCALHOST,
    ControlPlaneProcess,
    ManagedProcess,
    clean_env,
    free_port,
    start_control_plane,
)
from tests.sidecar.topology import SECRET, http_get, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BASE = "stages:\n  - stage_id: 1\n    max_inflight: 11\n"
OVERLAY = """base_config: base.yaml
stages:
  - stage_id: 1
    max_inflight: 12
platforms:
  cpu:
    stages:
      - stage_id: 1
        max_inflight: 13
"""
#: (layer, deploy YAML, platform, environment, flags) — each row adds one layer on top.
LEVELS: list[tuple[str, str, str | None, bool, list[str]]] = [
    ("defaults", "empty.yaml", None, False, []),
    ("base YAML", "base.yaml", None, False, []),
    ("overlay", "overlay.yaml", None, False, []),
    ("platform", "overlay.yaml", "cpu", False, []),
    ("environment", "overlay.yaml", "cpu", True, []),
    ("flag", "overlay.yaml", "cpu", True, ["--max-inflight", "15"]),
    ("stage-overrides", "overlay.yaml", "cpu", True,
     ["--max-inflight", "15", "--stage-overrides", '{"1": {"max_inflight": 16}}']),
]  # fmt: skip
EXPECTED = {"defaults": 64, "base YAML": 11, "overlay": 12, "platform": 13, "environment": 14,
            "flag": 15, "stage-overrides": 16}  # fmt: skip


@pytest.fixture(scope="module")
def pods(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ControlPlaneProcess, dict[str, int]]]:
    before = shm_segments()
    tmp = tmp_path_factory.mktemp("precedence")
    for name, text in (("empty.yaml", ""), ("base.yaml", BASE), ("overlay.yaml", OVERLAY)):
        (tmp / name).write_text(text)
    cp = start_control_plane(None, log_dir=tmp, name="cp-precedence")
    procs: list[ManagedProcess] = []
    ports: dict[str, int] = {}
    try:
        for layer, yaml_name, platform, use_env, flags in LEVELS:
            port = free_port()
            env = {"OMNI_STAGE_SECRET": "unused"}  # an unknown OMNI_STAGE_ variable is ignored
            argv = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "synthetic",
                    "--stage-id", "1", "--headless", "--control-plane", cp.url, "--secret", SECRET,
                    "--deploy-config", str(tmp / yaml_name), *flags]  # fmt: skip
            if platform:
                argv += ["--platform", platform]
            if use_env:
                env["OMNI_STAGE_MAX_INFLIGHT"] = "14"
            if layer == "environment":
                env["OMNI_STAGE_PORT"] = str(port)  # the only place this pod's port is given
            else:
                env["OMNI_STAGE_PORT"] = str(free_port())  # a flag beats it
                argv += ["--port", str(port)]
            proc = ManagedProcess(
                argv, name=layer.replace(" ", "-"), env=clean_env(env), log_dir=tmp
            )
            procs.append(proc.start())
            ports[layer] = port
        for proc, port in zip(procs, ports.values(), strict=True):
            proc.wait_http_ready(f"http://{LOCALHOST}:{port}/health", timeout=90)
        yield cp, ports
    finally:
        for proc in procs:
            proc.terminate(timeout=20)
        cp.proc.terminate(timeout=10)
    assert shm_segments() - before == set()


def test_each_layer_beats_the_ones_below(pods: tuple[ControlPlaneProcess, dict[str, int]]) -> None:
    cp, ports = pods
    url = f"{cp.url}/v1/pipelines/synthetic/stages/1/instances"
    capacity = {i["address"]: i["capacity"] for i in json.loads(http_get(url))["instances"]}
    seen = {layer: capacity.get(f"http://{LOCALHOST}:{port}") for layer, port in ports.items()}
    assert seen == EXPECTED


def test_a_bad_variable_names_itself() -> None:
    argv = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "synthetic"]
    env = clean_env({"OMNI_STAGE_MAX_INFLIGHT": "lots"})
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("omni-stage: error: OMNI_STAGE_MAX_INFLIGHT:"), done.stderr
