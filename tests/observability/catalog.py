"""What the observability tests check against: the files under test, the catalogue of every
series name that omni-mesh exposes (built from ``omni_mesh/observability/metrics.py``), and a
small PromQL scanner (metric names, label matchers, grouping labels)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from omni_mesh.observability import (
    audio_slo,
    autoscale_metrics,
    gc_metrics,
    kv_metrics,
    metrics,
    usage_metrics,
)

REPO = Path(__file__).resolve().parents[2]
OBS = REPO / "omni_mesh" / "observability"
PROMETHEUS_YML = OBS / "prometheus" / "prometheus.yml"
ALERTS_YML = OBS / "prometheus" / "alerts.yml"
GRAFANA = OBS / "grafana"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))
DATASOURCES_YML = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS_YML = GRAFANA / "provisioning" / "dashboards" / "omni-mesh.yaml"
ALERTS_TEST_YML = Path(__file__).with_name("alerts_test.yml")
COMPOSE = REPO / "compose"

# Labels every scraped series carries besides its own (target labels set by prometheus.yml).
TARGET_LABELS = frozenset({"job", "instance"})

# Series suffixes that the exposition adds per metric type (prometheus_client semantics:
# counters are declared without ``_total``).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}


@dataclass(frozen=True)
class Series:
    """One exposed series name: its metric family, type and labels."""

    name: str
    family: str
    kind: str
    labels: frozenset[str]


def _metric_objects() -> Iterator[MetricWrapperBase]:
    for owner in (
        metrics.ControlPlaneMetrics,
        metrics.AutoscaleMetrics,
        metrics.SidecarMetrics,
        gc_metrics.ProcessGcMetrics,
        kv_metrics.KvMetrics,
        audio_slo.AudioSloMetrics,
        usage_metrics.UsageMetrics,
    ):
        instance = owner(CollectorRegistry())
        for value in vars(instance).values():
            if isinstance(value, MetricWrapperBase):
                yield value


def catalogue() -> dict[str, Series]:
    """Every series name a scrape of an omni-mesh process can contain, with its labels."""
    out: dict[str, Series] = {}
    for metric in _metric_objects():
        family = metric._name
        kind = str(metric._type)
        labels = frozenset(metric._labelnames)
        for suffix in _SUFFIXES[kind]:
            extra = {"le"} if suffix == "_bucket" else set()
            out[family + suffix] = Series(family + suffix, family, kind, labels | extra)
    return out


def declared_names() -> set[str]:
    """The metric-name constants of ``metrics.py`` and the modules beside it that hold a
    component's series (every ``omni_*`` string constant)."""
    modules = (metrics, autoscale_metrics, gc_metrics, kv_metrics, audio_slo, usage_metrics)
    return {
        value
        for module in modules
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, str) and value.startswith("omni_")
    }


# ---- PromQL scanning ---------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME = re.compile(r"(?<![\w:])(omni_\w+)")
_SELECTOR = re.compile(r"(?<![\w:])(omni_\w+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def strip_strings(expr: str) -> str:
    return _STRING.sub('""', expr)


def metric_names(expr: str) -> set[str]:
    """``omni_*`` series names an expression selects (names inside strings do not count)."""
    return set(_NAME.findall(strip_strings(expr)))


def matcher_labels(expr: str) -> list[tuple[str, str]]:
    """``(metric, label)`` for every label matcher written on an ``omni_*`` selector."""
    found: list[tuple[str, str]] = []
    for match in _SELECTOR.finditer(expr):
        body = strip_strings(match.group(2))
        found.extend((match.group(1), label) for label in _MATCHER.findall(body))
    return found


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by/without/on/ignoring/group_left/group_right clauses."""
    labels: set[str] = set()
    for clause in _GROUPING.findall(strip_strings(expr)):
        labels.update(x.strip() for x in clause.split(",") if x.strip())
    return labels


# ---- the files under test ----------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One PromQL expression of an alert rule or a dashboard, and where it lives."""

    where: str
    expr: str


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS_YML)["groups"] for rule in group["rules"]]


def alert_queries() -> list[Query]:
    return [Query(f"alert {rule['alert']}", rule["expr"]) for rule in alert_rules()]


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in DASHBOARDS}


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # panels of collapsed rows


def dashboard_queries() -> list[Query]:
    queries = []
    for name, dash in dashboards().items():
        for panel in all_panels(dash):
            for target in panel.get("targets", []):
                where = f"{name}: {panel['title']} [{target['refId']}]"
                queries.append(Query(where, target["expr"]))
        for var in dash.get("templating", {}).get("list", []):
            query = var.get("query")
            text = query.get("query") if isinstance(query, dict) else query
            if text:
                queries.append(Query(f"{name}: variable {var['name']}", text))
    return queries


def grafana_to_promql(expr: str, *, rate_interval: str = "1m") -> str:
    """A dashboard expression with Grafana's variables replaced, for Prometheus itself."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)
