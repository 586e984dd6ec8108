"""Alerts and dashboards use only series that omni-mesh exposes, with labels those series carry;
the dashboards are well-formed and wired to the provisioned datasource."""

from __future__ import annotations

import pytest

from tests.observability.catalog import (
    DASHBOARD_PROVIDERS_YML,
    DATASOURCES_YML,
    TARGET_LABELS,
    Query,
    alert_queries,
    all_panels,
    catalogue,
    dashboard_queries,
    dashboards,
    declared_names,
    grouping_labels,
    load_yaml,
    matcher_labels,
    metric_names,
)

pytestmark = pytest.mark.unit

QUERIES = alert_queries() + dashboard_queries()
CATALOGUE = catalogue()


def test_catalogue_covers_every_declared_name() -> None:
    families = {series.family for series in CATALOGUE.values()}
    assert families == declared_names()
    # The suffix rules: counters only with _total, histograms only as _bucket/_sum/_count.
    assert "omni_stage_requests_total" in CATALOGUE
    assert "omni_stage_requests" not in CATALOGUE
    assert {"omni_cp_http_request_duration_seconds_bucket", "omni_cp_instances"} <= set(CATALOGUE)
    assert "omni_cp_http_request_duration_seconds" not in CATALOGUE


def test_the_scanner() -> None:
    expr = (
        'sum by (stage, le) (rate(omni_stage_request_duration_seconds_bucket{pipeline=~"omni_x",'
        ' route="hop"}[5m])) / on (stage) group_left omni_cp_instances'
    )
    assert metric_names(expr) == {"omni_stage_request_duration_seconds_bucket", "omni_cp_instances"}
    assert matcher_labels(expr) == [
        ("omni_stage_request_duration_seconds_bucket", "pipeline"),
        ("omni_stage_request_duration_seconds_bucket", "route"),
    ]
    assert grouping_labels(expr) == {"stage", "le"}


def test_there_is_something_to_check() -> None:
    assert len(alert_queries()) >= 10
    assert len(dashboard_queries()) >= 30


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q.where)
def test_metric_names_exist(query: Query) -> None:
    names = metric_names(query.expr)
    unknown = sorted(names - set(CATALOGUE))
    assert not unknown, f"{query.where}: not exposed by omni-mesh: {unknown} in {query.expr!r}"


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q.where)
def test_labels_exist(query: Query) -> None:
    for name, label in matcher_labels(query.expr):
        if name in CATALOGUE:
            allowed = CATALOGUE[name].labels | TARGET_LABELS
            assert label in allowed, f"{query.where}: {name} has no label {label!r}"
    names = metric_names(query.expr)
    if names:
        allowed = TARGET_LABELS.union(*(CATALOGUE[n].labels for n in names if n in CATALOGUE))
        unknown = grouping_labels(query.expr) - allowed
        assert not unknown, f"{query.where}: grouping by labels no series has: {sorted(unknown)}"


def test_alert_rules_are_complete() -> None:
    from tests.observability.catalog import alert_rules

    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        for key in ("summary", "description", "runbook_url"):
            assert rule["annotations"].get(key), f"{rule['alert']}: no {key}"
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor == rule["alert"].lower(), f"{rule['alert']}: runbook anchor {anchor!r}"


def test_runbook_anchors_exist_in_operations_doc() -> None:
    from tests.observability.catalog import REPO, alert_rules

    doc = (REPO / "docs" / "operations.md").read_text()
    headings = {ln.lstrip("#").strip().lower() for ln in doc.splitlines() if ln.startswith("#")}
    missing = [rule["alert"] for rule in alert_rules() if rule["alert"].lower() not in headings]
    assert not missing, f"docs/operations.md has no section for {missing}"


# ---- dashboards ------------------------------------------------------------------------------


def test_dashboards_use_the_provisioned_datasource() -> None:
    (datasource,) = load_yaml(DATASOURCES_YML)["datasources"]
    uid = datasource["uid"]
    for name, dash in dashboards().items():
        for panel in all_panels(dash):
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == uid, f"{name}: {panel['title']}"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == uid, f"{name}: {panel['title']}"
        for var in dash["templating"]["list"]:
            assert var["datasource"]["uid"] == uid, f"{name}: variable {var['name']}"


def test_dashboards_are_well_formed() -> None:
    boards = dashboards()
    assert set(boards) == {"pipeline-overview.json", "control-plane.json"}
    uids = [dash["uid"] for dash in boards.values()]
    assert len(set(uids)) == len(uids)
    for name, dash in boards.items():
        assert dash["title"].startswith("omni-mesh / "), name
        assert dash.get("id") is None, f"{name}: provisioned dashboards carry no numeric id"
        panels = list(all_panels(dash))
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells: set[tuple[int, int]] = set()
        for panel in panels:
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    assert (x, y) not in cells, f"{name}: {panel['title']} overlaps another panel"
                    cells.add((x, y))
            if panel["type"] != "row":
                assert panel["targets"], f"{name}: {panel['title']} has no query"
                assert panel.get("description"), f"{name}: {panel['title']} has no description"


def test_dashboards_cover_the_brief() -> None:
    """The panels an operator asked for, by the series they read."""
    used = {n for q in dashboard_queries() for n in metric_names(q.expr)}
    wanted = {
        # pipeline overview
        "omni_api_requests_total",
        "omni_api_request_duration_seconds_bucket",
        "omni_stage_in_flight",
        "omni_stage_handoff_bytes_total",
        "omni_stage_handoff_duration_seconds_bucket",
        "omni_stage_hop_retries_total",
        "omni_stage_rejected_total",
        "omni_stage_engine_queued",
        "omni_realtime_sessions",
        "omni_realtime_responses_total",
        "omni_realtime_first_audio_seconds_bucket",
        "omni_cp_sessions",
        # audio SLOs of streamed answers
        "omni_api_audio_first_seconds_bucket",
        "omni_api_audio_realtime_factor_bucket",
        "omni_api_audio_underruns_total",
        "omni_api_audio_underrun_seconds_total",
        "omni_api_audio_seconds_total",
        # control plane
        "omni_cp_instances",
        "omni_cp_registrations_total",
        "omni_cp_lease_expiries_total",
        "omni_cp_watchers",
        "omni_cp_http_request_duration_seconds_bucket",
    }
    assert wanted <= used, sorted(wanted - used)


def test_dashboard_provider_points_at_the_mounted_folder() -> None:
    (provider,) = load_yaml(DASHBOARD_PROVIDERS_YML)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/omni-mesh"
