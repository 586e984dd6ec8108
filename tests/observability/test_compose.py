"""The compose topologies and the Dockerfile.

No Docker engine runs here, so nothing is started: each compose file is checked by
``docker-compose config -q`` (Debian's docker-compose 1.29, when installed) and, always, by
reading it: every omni-mesh command is parsed by the real CLI parsers, every replica advertises
its own address, the healthchecks probe the right port and path, the dependencies wait for
health, the pods have shared memory, and Prometheus and Grafana are wired to the files of this
repository and scrape every process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.cli import build_parser as cp_parser
from omni_mesh.sidecar.cli_stage import parser as stage_parser
from omni_mesh.sidecar.cli_stage import settings_from_args
from tests.observability.catalog import (
    COMPOSE,
    DASHBOARD_PROVIDERS_YML,
    DATASOURCES_YML,
    REPO,
    load_yaml,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Topology:
    pipeline: str
    replicas: tuple[int, ...]


TOPOLOGIES = {
    "tiny-omni-1-1-1": Topology("tiny-omni", (1, 1, 1)),
    "tiny-omni-1-n-m": Topology("tiny-omni", (1, 2, 2)),
    "tiny-image-ar-dit": Topology("tiny-image", (1, 2)),
}
ENV = {"OMNI_SECRET": "compose-test-secret"}

_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (``${X}``, ``${X:-default}``, ``${X:?error}``)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op and op.endswith("?"):
            raise KeyError(f"{name}: {arg}")
        return arg if op and op.endswith("-") else ""

    return _VAR.sub(one, value).replace("$$", "$")


def load(name: str) -> dict[str, Any]:
    doc = load_yaml(COMPOSE / f"{name}.yaml")
    services: dict[str, Any] = interpolate(doc["services"], ENV)
    return services


def stage_services(services: dict[str, Any]) -> dict[str, Any]:
    return {
        name: svc
        for name, svc in services.items()
        if svc.get("command", [None])[0] == "omni-stage" and "--headless" in svc["command"]
    }


def stage_settings(command: list[str]) -> Any:
    args = stage_parser().parse_args(command[1:])
    return settings_from_args(args)


def healthcheck_url(svc: dict[str, Any]) -> str:
    test = " ".join(svc["healthcheck"]["test"])
    match = re.search(r"http://[^'\" ]+", test)
    assert match, test
    return match.group(0)


@pytest.fixture(params=sorted(TOPOLOGIES))
def topology(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def test_every_topology_has_a_file_and_a_target_list() -> None:
    assert {p.stem for p in COMPOSE.glob("*.yaml")} == set(TOPOLOGIES)
    assert {p.stem for p in (COMPOSE / "prometheus-targets").glob("*.yml")} == set(TOPOLOGIES)
    readme = (COMPOSE / "README.md").read_text()
    for name in TOPOLOGIES:
        assert f"{name}.yaml" in readme


def test_services(topology: str) -> None:
    services = load(topology)
    assert {"redis", "omni-cp-0", "omni-cp-1", "api-0", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        if "profiles" not in svc:
            assert "healthcheck" in svc, f"{name} has no healthcheck"
        assert svc.get("restart") == "unless-stopped", name


def test_stage_pods_match_the_topology(topology: str) -> None:
    want = TOPOLOGIES[topology]
    services = load(topology)
    stages = stage_services(services)
    assert len(get_pipeline(want.pipeline).stage_ids) == len(want.replicas)
    counts = [0] * len(want.replicas)
    addresses, host_ids = set(), set()
    for name, svc in stages.items():
        settings = stage_settings(svc["command"])
        assert settings.pipeline == want.pipeline and settings.headless
        counts[settings.stage_id] += 1
        # each replica advertises its own address and is its own host (no shm across containers)
        assert settings.address == f"http://{name}:{settings.port}", name
        assert settings.host_id == name
        addresses.add(settings.address)
        host_ids.add(settings.host_id)
        assert settings.host == "0.0.0.0"
        assert healthcheck_url(svc) == f"http://127.0.0.1:{settings.port}/health", name
        assert svc["shm_size"], f"{name}: /dev/shm not sized"
        assert svc["environment"]["OMNI_SECRET"] == ENV["OMNI_SECRET"]
        assert svc["depends_on"] == {
            "omni-cp-0": {"condition": "service_healthy"},
            "omni-cp-1": {"condition": "service_healthy"},
        }
    assert counts == list(want.replicas)
    assert len(addresses) == len(host_ids) == len(stages)


def test_control_planes(topology: str) -> None:
    services = load(topology)
    _, commands = cp_parser()
    cp_urls = set()
    for name in ("omni-cp-0", "omni-cp-1"):
        svc = services[name]
        assert svc["command"][:2] == ["omni-cp", "serve"]
        args = vars(commands["serve"].parse_args(svc["command"][2:]))
        assert args["host"] == "0.0.0.0"
        assert urlsplit(args["redis_url"]).hostname == "redis"  # the same Redis for both
        assert healthcheck_url(svc) == f"http://127.0.0.1:{args['port']}/healthz"
        assert svc["depends_on"] == {"redis": {"condition": "service_healthy"}}
        cp_urls.add(f"http://{name}:{args['port']}")
    # every pod knows both omni-cp, and only them
    for name, svc in services.items():
        if svc.get("command", [None])[0] == "omni-stage":
            assert set(stage_settings(svc["command"]).control_plane) == cp_urls, name


def test_api_server(topology: str) -> None:
    want = TOPOLOGIES[topology]
    services = load(topology)
    api = services["api-0"]
    settings = stage_settings(api["command"])
    assert settings.api_only and settings.pipeline == want.pipeline
    assert settings.address == f"http://api-0:{settings.port}"
    assert healthcheck_url(api) == f"http://127.0.0.1:{settings.port}/health"
    assert any(p.endswith(f":{settings.port}") for p in api["ports"])
    stages = stage_services(services)
    entry = [n for n, s in stages.items() if stage_settings(s["command"]).stage_id == 0]
    assert entry, "no stage-0 pod"
    for name in entry:
        assert api["depends_on"][name] == {"condition": "service_healthy"}


def test_dependencies_wait_for_health(topology: str) -> None:
    services = load(topology)
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health"


def _mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """container path → host path of a service's bind mounts."""
    out = {}
    for volume in svc["volumes"]:
        parts = volume.split(":")
        if parts[0].startswith("."):
            out[parts[1]] = (COMPOSE / parts[0]).resolve()
    return out


def test_prometheus_scrapes_every_process(topology: str) -> None:
    services = load(topology)
    mounts = _mounts(services["prometheus"])
    obs = REPO / "omni_mesh" / "observability"
    assert mounts["/etc/prometheus/prometheus.yml"] == obs / "prometheus" / "prometheus.yml"
    assert mounts["/etc/prometheus/alerts.yml"] == obs / "prometheus" / "alerts.yml"
    targets_file = mounts["/etc/prometheus/targets/omni-mesh.yml"]
    assert targets_file == COMPOSE / "prometheus-targets" / f"{topology}.yml"
    groups = {g["labels"]["component"]: set(g["targets"]) for g in load_yaml(targets_file)}
    stages = {
        f"{n}:{stage_settings(s['command']).port}" for n, s in stage_services(services).items()
    }
    api = stage_settings(services["api-0"]["command"])
    assert groups == {
        "omni-cp": {"omni-cp-0:7700", "omni-cp-1:7700"},
        "omni-stage": stages,
        "omni-api": {f"api-0:{api.port}"},
    }


def test_grafana_is_provisioned(topology: str) -> None:
    services = load(topology)
    mounts = _mounts(services["grafana"])
    grafana = REPO / "omni_mesh" / "observability" / "grafana"
    assert mounts["/etc/grafana/provisioning"] == grafana / "provisioning"
    (provider,) = load_yaml(DASHBOARD_PROVIDERS_YML)["providers"]
    assert mounts[provider["options"]["path"]] == grafana
    (datasource,) = load_yaml(DATASOURCES_YML)["datasources"]
    url = urlsplit(datasource["url"])
    assert url.hostname in services and url.port == 9090
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_omni_services_share_one_image_built_from_the_repo(topology: str) -> None:
    services = load(topology)
    omni = [s for s in services.values() if s.get("command", [""])[0].startswith("omni-")]
    assert {s["image"] for s in omni} == {"omni-mesh:dev"}
    for svc in omni:
        assert (COMPOSE / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == (
            REPO / "Dockerfile"
        )


def test_secret_is_required(topology: str) -> None:
    doc = load_yaml(COMPOSE / f"{topology}.yaml")
    with pytest.raises(KeyError, match="OMNI_SECRET"):
        interpolate(doc["services"], {})


# ---- docker-compose config ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.skip(
            "docker-compose not installed (Debian package `docker-compose`; `make test` "
            "installs it as root): the compose files were only checked by reading them"
        )
    return path


def _compose_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "COMPOSE_"))}
    env.update(extra)
    return env


def test_docker_compose_config(docker_compose: str, topology: str, tmp_path: Path) -> None:
    argv = [docker_compose, "-f", str(COMPOSE / f"{topology}.yaml"), "-p", "omni-test"]
    ok = subprocess.run(
        [*argv, "config", "-q"],
        env=_compose_env(**ENV),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run(
        [*argv, "config", "-q"],
        env=_compose_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode != 0 and "OMNI_SECRET" in missing.stderr, missing.stderr


# ---- Dockerfile --------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    steps = _instructions()
    words = [w for w, _ in steps]
    assert "ENTRYPOINT" not in words and "CMD" not in words, "compose sets command:"
    assert ("ARG", "PYTHON_VERSION=3.11") in steps
    assert all(rest.startswith("python:${PYTHON_VERSION}-slim") for w, rest in steps if w == "FROM")
    user = [rest for w, rest in steps if w == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root"), "must not run as root"
    runs = " ".join(rest for w, rest in steps if w == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs and ("ARG", "TORCH_VERSION=2.13.0") in steps
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in steps
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip()}
    for w, rest in steps:
        if w == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (REPO / src).exists(), src
                assert src not in ignored, f"{src} is in .dockerignore"
    assert {".venv", ".git", "tests"} <= ignored
