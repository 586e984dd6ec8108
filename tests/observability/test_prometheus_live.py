"""A real Prometheus (Debian's binary) scrapes a real topology — ``omni-cp serve`` with its
embedded Redis, three ``omni-stage`` pods of the ``synthetic`` pipeline and an ``--api-only``
API server — every second, with the project's own ``prometheus.yml`` (targets swapped for the
loopback ones) and ``alerts.yml``. Then:

- the control plane's and the stages' series arrive with the job labels that the rules expect,
  and with the values the traffic we sent implies;
- every alert rule loads and evaluates without error, and none is active on a healthy topology;
- every dashboard query is valid PromQL, and the ones that must have data do;
- a stage pod killed with SIGKILL shows as a lease expiry and raises OmniStageNoHealthyInstance.

Everything started here is stopped at the end, and checked to be gone: processes, the port,
Prometheus' temporary directory, shared-memory segments.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.observability.catalog import (
    ALERTS_YML,
    PROMETHEUS_YML,
    alert_rules,
    catalogue,
    dashboard_queries,
    grafana_to_promql,
    load_yaml,
)
from tests.procs import LOCALHOST, ManagedProcess, free_port, pid_alive, wait_until
from tests.sidecar.topology import Topology, http_get, post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCRAPE = "1s"


@dataclass
class Prometheus:
    proc: ManagedProcess
    url: str
    workdir: Path

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        body = json.loads(http_get(f"{self.url}/api/v1/{path}{query}"))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def values(self, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
        """An instant query as ``{label values: value}``."""
        return {
            tuple(r["metric"].get(label, "") for label in labels): float(r["value"][1])
            for r in self.query(expr)
        }

    def active_alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts


def _host_port(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


def _config(topo: Topology, port: int) -> dict[str, Any]:
    """The project's prometheus.yml with a 1 s interval and the topology's loopback targets."""
    assert topo.cp is not None
    config: dict[str, Any] = load_yaml(PROMETHEUS_YML)
    config["global"].update(
        scrape_interval=SCRAPE, scrape_timeout=SCRAPE, evaluation_interval=SCRAPE
    )
    config["rule_files"] = [str(ALERTS_YML)]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["prometheus"]["static_configs"] = [{"targets": [f"{LOCALHOST}:{port}"]}]
    omni = jobs["omni-mesh"]
    del omni["file_sd_configs"]
    stage_urls = [url for urls in topo.urls.values() for url in urls]
    omni["static_configs"] = [
        {"targets": [_host_port(topo.cp.url)], "labels": {"component": "omni-cp"}},
        {"targets": [_host_port(u) for u in stage_urls], "labels": {"component": "omni-stage"}},
        {"targets": [_host_port(topo.api_url)], "labels": {"component": "omni-api"}},
    ]
    return config


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((LOCALHOST, port)) == 0


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("prometheus not installed (Debian package; `make test` installs it as root)")
    return path


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    before = shm_segments()
    topo = Topology("synthetic", [1, 1, 1], tmp_path_factory.mktemp("topology"))
    try:
        topo.start()
        yield topo
    finally:
        topo.close()
    procs = [p for ps in topo.stages.values() for p in ps] + [topo.api]
    assert topo.cp is not None
    procs.append(topo.cp.proc)
    assert not [p.name for p in procs if p is not None and p.alive], "processes left running"
    wait_until(lambda: not (shm_segments() - before), 5.0, message="shm segments leaked")


@pytest.fixture(scope="module")
def prometheus(
    prometheus_bin: str, topology: Topology, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="omni-test-prometheus-"))
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(_config(topology, port)))
    proc = ManagedProcess(
        [
            prometheus_bin,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            "--storage.tsdb.retention.time=1h",
            f"--web.listen-address={LOCALHOST}:{port}",
        ],
        name="prometheus",
        log_dir=tmp_path_factory.mktemp("prometheus-logs"),
    )
    try:
        proc.start()
        prom = Prometheus(proc, f"http://{LOCALHOST}:{port}", workdir)
        proc.wait_http_ready(f"{prom.url}/-/ready", timeout=30)
        yield prom
    finally:
        proc.terminate(timeout=15)
        shutil.rmtree(workdir, ignore_errors=True)
    assert not pid_alive(proc.pid), "prometheus still running"
    assert not _port_open(port), f"port {port} still open"
    assert not workdir.exists(), f"{workdir} left behind"


def _generate(topo: Topology, count: int) -> None:
    for i in range(count):
        status, body = post_json(topo.api_url + "/v1/generate", {"prompt": f"x{i}"})
        assert status == 200, body


def _wait_value(prom: Prometheus, expr: str, want: float, timeout: float = 20.0) -> None:
    def seen() -> bool:
        got = prom.query(expr)
        return len(got) == 1 and float(got[0]["value"][1]) == want

    wait_until(seen, timeout, interval=0.2, message=lambda: f"{expr}: {prom.query(expr)}")


REQUESTS = 3  # per batch; two batches so that rate() has something to see


@pytest.fixture(scope="module")
def scraped(prometheus: Prometheus, topology: Topology) -> Prometheus:
    """Prometheus after it has scraped every target and seen 2 * REQUESTS requests."""
    wait_until(
        lambda: (
            prometheus.values('count(up{job=~"omni-cp|omni-stage|omni-api"} == 1)') == {(): 5.0}
        ),
        30.0,
        interval=0.2,
        message=lambda: f"targets: {prometheus.api('targets')['activeTargets']}",
    )

    def stages_at(n: int) -> str:  # how many stages Prometheus has seen execute n requests
        return f'count(sum by (stage) (omni_stage_requests_total{{job="omni-stage"}}) == {n})'

    _generate(topology, REQUESTS)
    _wait_value(prometheus, stages_at(REQUESTS), 3.0)
    time.sleep(1.5)  # one more scrape between the batches
    _generate(topology, REQUESTS)
    _wait_value(prometheus, stages_at(2 * REQUESTS), 3.0)
    return prometheus


def test_control_plane_series(scraped: Prometheus) -> None:
    healthy = scraped.values('omni_cp_instances{state="healthy"}', "job", "pipeline", "stage")
    assert healthy == {
        ("omni-cp", "synthetic", "0"): 1.0,
        ("omni-cp", "synthetic", "1"): 1.0,
        ("omni-cp", "synthetic", "2"): 1.0,
    }
    # three stage pods and the --api-only server (registered with role api, in no stage pool)
    assert scraped.values("sum(omni_cp_registrations_total)") == {(): 4.0}
    assert scraped.values("omni_cp_sweeper_leader", "job") == {("omni-cp",): 1.0}


def test_stage_series(scraped: Prometheus) -> None:
    executed = scraped.values(
        'sum by (job, stage) (omni_stage_requests_total{route="hop", outcome="ok"})', "job", "stage"
    )
    n = float(2 * REQUESTS)
    assert executed == {("omni-stage", "0"): n, ("omni-stage", "1"): n, ("omni-stage", "2"): n}
    pairs = scraped.values(
        "sum by (job, from_stage, to_stage) (omni_stage_handoff_bytes_total)",
        "job",
        "from_stage",
        "to_stage",
    )
    assert set(pairs) == {
        ("omni-api", "-1", "0"),  # from_stage -1: the API server's entry hand-off
        ("omni-stage", "0", "1"),
        ("omni-stage", "1", "2"),
    }
    assert all(v > 0 for v in pairs.values()), pairs
    in_flight = scraped.values("omni_stage_in_flight", "stage")
    assert in_flight == {("0",): 0.0, ("1",): 0.0, ("2",): 0.0}


def test_only_catalogued_series_are_exposed(scraped: Prometheus) -> None:
    names = {n for n in scraped.api("label/__name__/values") if n.startswith("omni_")}
    assert names, "no omni_* series ingested"
    unknown = names - set(catalogue())
    assert not unknown, f"exposed but not in the catalogue built from metrics.py: {unknown}"


def test_rules_load_and_evaluate(scraped: Prometheus) -> None:
    expected = {r["alert"] for r in alert_rules()}

    def rules() -> list[dict[str, Any]]:
        groups = scraped.api("rules")["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def evaluated() -> bool:
        return all(r.get("health") == "ok" for r in rules())

    wait_until(evaluated, 15.0, interval=0.2, message=lambda: json.dumps(rules(), indent=1))
    loaded = rules()
    assert {r["name"] for r in loaded} == expected
    assert all(r["type"] == "alerting" and not r.get("lastError") for r in loaded)
    # A healthy topology raises nothing (absent() may be pending before the first scrape).
    wait_until(
        lambda: not scraped.active_alerts(),
        10.0,
        interval=0.2,
        message=lambda: json.dumps(scraped.active_alerts(), indent=1),
    )


# Panels that must show data after the traffic above (the others need failures, retries,
# rejections or client-API series; all must still be valid PromQL).
MUST_HAVE_DATA = (
    "Entry hand-offs/s",
    "Stage executions/s",
    "Stage latency p50 / p99",
    "In flight per stage",
    "Healthy instances per stage",
    "Engine queue per instance",
    "Hand-off bytes/s per stage pair",
    "Hand-off latency p50 / p99",
    "Hand-offs/s per stage pair",
    "omni-cp up",
    "Healthy instances",
    "Sweeper leader",
    "Instances by stage and state",
    "Registrations and leaves /s [A]",  # [B] (graceful leaves) has none yet
    "API requests/s by route and status",
    "Open watches by omni-cp and mode",
    "Sweep duration p99",
)


def test_dashboard_queries_run(scraped: Prometheus) -> None:
    empty = []
    for query in dashboard_queries():
        if "variable" in query.where:
            continue  # Grafana's label_values(), not PromQL
        result = scraped.query(grafana_to_promql(query.expr, rate_interval="30s"))
        if not result and any(title in query.where for title in MUST_HAVE_DATA):
            empty.append(query.where)
    assert not empty, f"panels without data: {empty}"


def test_killed_stage_raises_the_alerts(scraped: Prometheus, topology: Topology) -> None:
    """Runs last in this module: it takes stage 2 down for good."""
    victim = topology.stages[2][0]
    os.kill(victim.pid, signal.SIGKILL)  # the sidecar only: its engine cleans up
    _wait_value(scraped, 'sum(omni_cp_lease_expiries_total{stage="2"})', 1.0, timeout=20.0)

    def alert_states() -> dict[str, str]:
        return {
            a["labels"]["alertname"]: a["state"]
            for a in scraped.active_alerts()
            if a["labels"].get("stage") == "2" or a["labels"].get("job") == "omni-stage"
        }

    wait_until(
        lambda: {"OmniStageNoHealthyInstance", "OmniPodDown"} <= set(alert_states()),
        20.0,
        interval=0.2,
        message=lambda: json.dumps(scraped.active_alerts(), indent=1),
    )
    (alert,) = [
        a
        for a in scraped.active_alerts()
        if a["labels"]["alertname"] == "OmniStageNoHealthyInstance"
    ]
    assert alert["labels"]["pipeline"] == "synthetic"
    assert alert["labels"]["severity"] == "critical"
    assert alert["state"] in ("pending", "firing")
