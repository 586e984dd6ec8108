"""``k8s/autoscaling/``: the per-stage autoscalers validate offline (core objects against the
bundled Kubernetes schemas, KEDA ScaledObjects against a schema written from KEDA's documented
fields, their HPA ``behavior`` against the core HPA schema) and fit omni-mesh: one autoscaler per
stage Deployment of the base manifests, each following ``omni_cp_desired_replicas`` for its
own stage with the bounds of that stage's policy, and every policy a valid PUT body. The
CronJob's script PUTs the policies on a real omni-cp."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from omni_mesh.control_plane.schema import ScalePolicyRequest, ScaleStatus
from omni_mesh.observability.autoscale_metrics import CP_DESIRED_REPLICAS
from tests.k8s.keda_schema import SCALED_OBJECT
from tests.procs import start_control_plane

K8S = Path(__file__).resolve().parents[2] / "k8s"
AUTOSCALING = K8S / "autoscaling"
Doc = dict[str, Any]

pytestmark = pytest.mark.unit


def _load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


POLICY_DOCS = _load(AUTOSCALING / "00-policies.yaml")
SCALED_OBJECTS = _load(AUTOSCALING / "keda" / "scaledobjects.yaml")
HPAS = _load(AUTOSCALING / "hpa" / "hpas.yaml")
STAGE_DEPLOYMENTS = {
    d["metadata"]["name"]: d
    for path in sorted((K8S / "tiny-omni").glob("*.yaml"))
    for d in _load(path)
    if d["kind"] == "Deployment" and d["metadata"]["labels"].get("omni-mesh/role") == "stage"
}
[POLICIES] = [d for d in POLICY_DOCS if d["kind"] == "ConfigMap"]
CORE = [*POLICY_DOCS, *HPAS]


def _policy(stage: str) -> ScalePolicyRequest:
    return ScalePolicyRequest.model_validate_json(POLICIES["data"][f"stage-{stage}.json"])


def _ids(docs: list[Doc]) -> list[str]:
    return [f"{d['kind']}/{d['metadata']['name']}" for d in docs]


@pytest.mark.parametrize("doc", CORE, ids=_ids(CORE))
def test_core_objects_validate_against_current_kubernetes(doc: Doc) -> None:
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("doc", SCALED_OBJECTS, ids=_ids(SCALED_OBJECTS))
def test_scaled_objects_validate_against_keda_fields(doc: Doc) -> None:
    jsonschema.validate(doc, SCALED_OBJECT, cls=jsonschema.Draft202012Validator)
    # The HPA behaviour KEDA passes on is the core HPA's: validate it inside one.
    hpa = copy.deepcopy(HPAS[0])
    hpa["spec"]["behavior"] = doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    kubernetes_validate.validate(hpa, kubernetes_validate.latest_version(), strict=True)


def test_the_schema_refuses_what_keda_would() -> None:
    bad = copy.deepcopy(SCALED_OBJECTS[0])
    bad["spec"]["triggers"][0]["metadata"]["treshold"] = "1"  # a typo
    with pytest.raises(jsonschema.ValidationError, match="treshold"):
        jsonschema.validate(bad, SCALED_OBJECT)
    bad = copy.deepcopy(SCALED_OBJECTS[0])
    bad["spec"]["minReplicas"] = 1  # the HPA's name, not KEDA's
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate(bad, SCALED_OBJECT)


def test_one_keda_and_one_hpa_autoscaler_per_stage_deployment() -> None:
    assert {d["spec"]["scaleTargetRef"]["name"] for d in SCALED_OBJECTS} == set(STAGE_DEPLOYMENTS)
    assert {d["spec"]["scaleTargetRef"]["name"] for d in HPAS} == set(STAGE_DEPLOYMENTS)
    assert len(SCALED_OBJECTS) == len(HPAS) == len(STAGE_DEPLOYMENTS)
    stage_ids = {d["metadata"]["labels"]["omni-mesh/stage-id"] for d in STAGE_DEPLOYMENTS.values()}
    assert {k.removeprefix("stage-").removesuffix(".json") for k in POLICIES["data"]
            if k.endswith(".json")} == stage_ids  # fmt: skip


@pytest.mark.parametrize("doc", SCALED_OBJECTS, ids=_ids(SCALED_OBJECTS))
def test_scaled_object_follows_its_stage_gauge_within_its_policy(doc: Doc) -> None:
    target = STAGE_DEPLOYMENTS[doc["spec"]["scaleTargetRef"]["name"]]
    stage = target["metadata"]["labels"]["omni-mesh/stage-id"]
    [trigger] = doc["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert query == f'max({CP_DESIRED_REPLICAS}{{pipeline="tiny-omni",stage="{stage}"}})'
    # AverageValue with threshold 1: the HPA asks for exactly the desired count.
    assert (trigger["metricType"], trigger["metadata"]["threshold"]) == ("AverageValue", "1")
    policy = _policy(stage).autoscale
    spec = doc["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (
        policy.min_replicas,
        policy.max_replicas,
    )
    assert not re.search(r"\bsum\b|\bavg\b", query)  # every omni-cp exports the same gauge


@pytest.mark.parametrize("doc", HPAS, ids=_ids(HPAS))
def test_hpa_follows_its_stage_gauge_within_its_policy(doc: Doc) -> None:
    ref = doc["spec"]["scaleTargetRef"]
    target = STAGE_DEPLOYMENTS[ref["name"]]
    assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
    stage = target["metadata"]["labels"]["omni-mesh/stage-id"]
    [metric] = doc["spec"]["metrics"]
    external = metric["external"]
    assert external["metric"]["name"] == CP_DESIRED_REPLICAS
    assert external["metric"]["selector"]["matchLabels"] == {
        "pipeline": "tiny-omni",
        "stage": stage,
    }
    assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
    policy = _policy(stage).autoscale
    # An HPA cannot scale to zero: its minimum is the policy's, at least 1.
    assert doc["spec"]["minReplicas"] == max(1, policy.min_replicas)
    assert doc["spec"]["maxReplicas"] == policy.max_replicas


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_cronjob_script_puts_every_policy_on_a_real_control_plane(tmp_path: Path) -> None:
    folder = tmp_path / "omni-autoscale"
    folder.mkdir()
    for name, text in POLICIES["data"].items():
        (folder / name).write_text(text)
    [cron] = [d for d in POLICY_DOCS if d["kind"] == "CronJob"]
    [container] = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "/etc/omni-autoscale/put_policies.py"]
    env = {e["name"]: e["value"] for e in container["env"]}
    cp = start_control_plane(None, log_dir=tmp_path)
    try:
        run_env = {**os.environ, **env, "OMNI_CP_URL": cp.url}
        for _ in range(2):  # idempotent
            done = subprocess.run([sys.executable, str(folder / "put_policies.py")], env=run_env,
                                  capture_output=True, text=True, timeout=30)  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
        for stage in ("0", "1", "2"):
            url = f"{cp.url}/v1/pipelines/{env['OMNI_PIPELINE']}/stages/{stage}/scale"
            with urllib.request.urlopen(url, timeout=5) as resp:
                status = ScaleStatus.model_validate_json(resp.read())
            assert status.policy == _policy(stage).autoscale
        # A policy the control plane refuses makes the job fail, naming the stage and field.
        bad_policy = '{"autoscale": {"min_replicas": 3, "max_replicas": 1}}'
        (folder / "stage-2.json").write_text(bad_policy)
        done = subprocess.run([sys.executable, str(folder / "put_policies.py")], env=run_env,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert done.returncode == 1, done.stdout + done.stderr
        assert "stage 2:" in done.stderr and "max_replicas" in done.stderr, done.stderr
    finally:
        cp.proc.cleanup()
