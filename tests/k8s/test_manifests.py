"""The Kubernetes manifests in ``k8s/`` validate offline against the newest Kubernetes schemas
that ``kubernetes-validate`` bundles (strict: unknown fields are errors), and they fit together
and fit omni-mesh: selectors match their pods, every ConfigMap/Secret a pod uses exists, stage
pods have a memory ``/dev/shm``, ``/health`` probes, a preStop drain and a grace period longer
than the drain, GPU variants request GPUs, the commands parse with omni-stage's and omni-cp's
own parsers, the deploy YAML loads, and promtool accepts the scrape job."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.configs.settings import ControlPlaneSettings
from omni_mesh.control_plane.cli import build_parser as cp_parser
from omni_mesh.control_plane.schema import DrainRequest
from omni_mesh.sidecar.cli_stage import parser as stage_parser
from omni_mesh.sidecar.cli_stage import settings_from_args

K8S = Path(__file__).resolve().parents[2] / "k8s"
BASE = K8S / "tiny-omni"
GPU = K8S / "gpu"
Doc = dict[str, Any]
HEARTBEAT_S = ControlPlaneSettings.model_fields["heartbeat_interval_ms"].default / 1000


def _docs(*folders: Path) -> Iterator[tuple[str, Doc]]:
    for folder in folders:
        for path in sorted(folder.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc is not None:
                    yield f"{path.relative_to(K8S)}:{doc['kind']}/{doc['metadata']['name']}", doc


def _labels(doc: Doc) -> dict[str, str]:
    return dict(doc["spec"]["template"]["metadata"]["labels"])


def _container(doc: Doc) -> Doc:
    [container] = doc["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _args(container: Doc) -> list[str]:
    """The container's args with ``$(VAR)`` filled in as the kubelet would."""
    values = {"POD_IP": "10.1.2.3", "POD_NAME": "pod-abc"}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in container["args"]]


ALL = list(_docs(BASE, GPU))
BY_KIND: dict[str, dict[str, Doc]] = {}
for _, _doc in _docs(BASE):
    BY_KIND.setdefault(_doc["kind"], {})[_doc["metadata"]["name"]] = _doc
DEPLOYMENTS = [(label, d) for label, d in ALL if d["kind"] == "Deployment"]
STAGES = [(label, d) for label, d in DEPLOYMENTS if _labels(d).get("omni-mesh/role") == "stage"]


@pytest.mark.parametrize(("label", "doc"), ALL, ids=[label for label, _ in ALL])
def test_validates_against_current_kubernetes(label: str, doc: Doc) -> None:
    version = kubernetes_validate.latest_version()
    assert tuple(map(int, version.split(".")[:2])) >= (1, 33)
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_whole_deployment_is_there() -> None:
    assert set(BY_KIND["Deployment"]) == {
        "omni-redis", "omni-cp", "omni-thinker", "omni-talker", "omni-code2wav", "omni-api",
    }  # fmt: skip
    assert BY_KIND["Deployment"]["omni-cp"]["spec"]["replicas"] == 2
    assert set(BY_KIND["Service"]) == {"omni-redis", "omni-cp", "omni-api"}
    assert set(BY_KIND["ConfigMap"]) == {"omni-deploy", "omni-prometheus-scrape"}
    assert set(BY_KIND["Secret"]) == {"omni-secret"}
    assert {n for n in BY_KIND["NetworkPolicy"]} >= {"omni-stage-pods", "omni-redis"}
    gpu = {d["metadata"]["name"] for _, d in _docs(GPU)}
    assert gpu == {"omni-thinker", "omni-talker", "omni-code2wav"}


@pytest.mark.parametrize(("label", "doc"), DEPLOYMENTS, ids=[label for label, _ in DEPLOYMENTS])
def test_deployment_selectors_and_references(label: str, doc: Doc) -> None:
    selector = doc["spec"]["selector"]["matchLabels"]
    assert selector.items() <= _labels(doc).items()
    pod = doc["spec"]["template"]["spec"]
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            assert volume["configMap"]["name"] in BY_KIND["ConfigMap"]
    for env in _container(doc).get("env", []):
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            secret = BY_KIND["Secret"][ref["name"]]
            assert ref["key"] in secret["stringData"]


def test_services_select_pods() -> None:
    for name, service in BY_KIND["Service"].items():
        matched = [
            d
            for d in BY_KIND["Deployment"].values()
            if service["spec"]["selector"].items() <= _labels(d).items()
        ]
        assert len(matched) == 1, name
        ports = {p["name"] for p in _container(matched[0])["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


@pytest.mark.parametrize(("label", "doc"), STAGES, ids=[label for label, _ in STAGES])
def test_stage_pods(label: str, doc: Doc) -> None:
    pod = doc["spec"]["template"]["spec"]
    container = _container(doc)
    # /dev/shm is a memory-backed emptyDir
    [shm] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    # probes on /health
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    # a preStop drain: out of discovery first, a wait, SIGTERM only then; a grace period
    # longer than the preStop's calls, its wait and the drain together
    args = settings_from_args(stage_parser().parse_args(_args(container)))
    script = _prestop_script(container)
    drain_at = script.index(f"{args.control_plane[0]}/v1/instances/%s/drain")
    wait = re.search(r"^sleep (\d+)$", script, re.MULTILINE)
    assert wait is not None, script
    assert drain_at < wait.start() < script.index("kill -TERM 1"), script
    assert int(wait.group(1)) >= 2 * HEARTBEAT_S  # every sender's pool has dropped the pod
    calls_s = 2 * 2  # the two HTTP calls' timeouts
    assert (
        pod["terminationGracePeriodSeconds"] > args.drain_timeout_s + int(wait.group(1)) + calls_s
    )
    # the command is omni-stage's, for a headless stage of tiny-omni advertising its own address
    assert container["command"] == ["omni-stage"]
    assert (args.pipeline, args.headless) == ("tiny-omni", True)
    assert args.stage_id == int(_labels(doc)["omni-mesh/stage-id"])
    assert args.advertise_address == "http://10.1.2.3:9000"
    assert args.host_id == "pod-abc"
    assert args.control_plane == ("http://omni-cp:7700",)
    # GPUs: one per pod in the GPU variants, none in the CPU walk-through
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if label.startswith("gpu/") else None)
    assert (args.platform == "cuda") == label.startswith("gpu/")


def _prestop_script(container: Doc) -> str:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    return str(command[2])


def test_prestop_drains_the_instance_on_the_control_plane(tmp_path: Path) -> None:
    """The preStop's drain call, run against a stand-in for the pod's /health and omni-cp: it
    reads its instance id from /health and POSTs a valid drain request for it."""
    seen: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(("GET", self.path, b""))
            self._answer({"status": "ok", "stage_id": 1, "instance_id": "abc123"})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(("POST", self.path, body))
            self._answer({})

        def _answer(self, body: Doc) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        here = f"http://127.0.0.1:{server.server_address[1]}"
        for _, doc in STAGES:
            script = _prestop_script(_container(doc))
            code = re.search(r"python -c '\n(.*?)\n' \|\|", script, re.DOTALL)
            assert code is not None, script
            code_text = code.group(1).replace("http://127.0.0.1:9000", here)
            code_text = code_text.replace("http://omni-cp:7700", here)
            subprocess.run([sys.executable, "-c", code_text], check=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert len(seen) == 2 * len(STAGES)
    for get, post in zip(seen[::2], seen[1::2], strict=True):
        assert get[:2] == ("GET", "/health")
        assert post[:2] == ("POST", "/v1/instances/abc123/drain")
        DrainRequest.model_validate_json(post[2])


def test_api_and_control_plane_commands() -> None:
    api = _container(BY_KIND["Deployment"]["omni-api"])
    args = settings_from_args(stage_parser().parse_args(_args(api)))
    assert args.api_only and args.port == 8000
    assert (
        BY_KIND["Deployment"]["omni-api"]["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        > args.drain_timeout_s
    )
    cp = _container(BY_KIND["Deployment"]["omni-cp"])
    parser, _ = cp_parser()
    parsed = vars(parser.parse_args(cp["command"][1:] + cp["args"]))
    assert parsed["redis_url"] == "redis://omni-redis:6379/0"
    assert cp["readinessProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize("platform", [None, "cuda"])
def test_deploy_config_loads(platform: str | None, tmp_path: Path) -> None:
    text = BY_KIND["ConfigMap"]["omni-deploy"]["data"]["deploy.yaml"]
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    config = load_deploy_config(path, get_pipeline("tiny-omni"), platform=platform)
    assert config is not None


def test_network_policy_lets_only_pods_and_omni_cp_reach_stage_pods() -> None:
    policy = BY_KIND["NetworkPolicy"]["omni-stage-pods"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"omni-mesh/role": "stage"}
    assert policy["policyTypes"] == ["Ingress"]
    sources = [peer for rule in policy["ingress"] for peer in rule["from"]]
    roles = [
        expr["values"]
        for peer in sources
        for expr in peer.get("podSelector", {}).get("matchExpressions", [])
    ]
    assert roles == [["stage", "api", "control-plane"]]
    others = [p for p in sources if "matchExpressions" not in p.get("podSelector", {})]
    assert all(
        p["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"} for p in others
    )
    redis = BY_KIND["NetworkPolicy"]["omni-redis"]["spec"]
    assert redis["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"omni-mesh/role": "control-plane"}}}
    ]


def test_pods_are_annotated_for_prometheus_and_promtool_accepts_the_job(tmp_path: Path) -> None:
    for name, doc in BY_KIND["Deployment"].items():
        if name == "omni-redis":
            continue
        notes = doc["spec"]["template"]["metadata"]["annotations"]
        port = str(_container(doc)["ports"][0]["containerPort"])
        assert notes == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": port,
            "prometheus.io/path": "/metrics",
        }, name
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; `make test` installs it)")
    job = yaml.safe_load(
        BY_KIND["ConfigMap"]["omni-prometheus-scrape"]["data"]["omni-mesh-scrape.yml"]
    )
    [scrape] = job["scrape_configs"]
    assert scrape["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"names": ["omni-mesh"]}}
    ]
    # Debian's Prometheus is built without Kubernetes discovery: check the rest of the job
    # (the relabelling) with a static target in its place.
    del scrape["kubernetes_sd_configs"]
    scrape["static_configs"] = [{"targets": ["10.1.2.3:9000"]}]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "5s"}, **job}))
    done = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
