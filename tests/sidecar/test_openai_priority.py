"""The OpenAI-compatible routes take an optional ``priority`` body field as well as the
``X-Omni-Priority`` header; the header wins when both are given, and a bad field is a 400 naming
it. Through a real API server (``--api-only``, tiny-omni) whose deploy config accepts only the
``low`` class on these routes, so the class a request ends up in shows before any stage runs: a
``high`` request is refused with a 400 naming ``priority``, a ``low`` one goes on to the (empty)
stage-0 pool and runs out of its short deadline there instead."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.sidecar.topology import Topology

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROUTES = ["/v1/audio/speech", "/v1/chat/completions", "/v1/completions", "/v1/images/generations"]
DEPLOY = "priority_classes:\n" + "".join(f"  {route}: [low]\n" for route in ROUTES)
BODIES: dict[str, dict[str, object]] = {
    "/v1/audio/speech": {"model": "tiny-omni", "input": "hi"},
    "/v1/chat/completions": {"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "tiny-omni", "prompt": "hi"},
}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    tmp = tmp_path_factory.mktemp("openai-priority")
    deploy = tmp / "deploy.yaml"
    deploy.write_text(DEPLOY)
    t = Topology("tiny-omni", [0, 0, 0], tmp, extra_stage_args=["--deploy-config", str(deploy)])
    try:
        yield t.start(stages=[])
    finally:
        t.close()


def _post(
    topo: Topology, route: str, body: dict[str, object], header: str | None = None
) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json", "X-Omni-Timeout-S": "0.3"}
    if header is not None:
        headers["X-Omni-Priority"] = header
    req = urllib.request.Request(
        topo.api_url + route, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _refused_for_priority(status: int, answer: dict[str, object]) -> bool:
    error = answer.get("error")
    assert isinstance(error, dict), answer
    return status == 400 and error["param"] == "priority" and "not accepted" in error["message"]


@pytest.mark.parametrize("route", sorted(BODIES))
def test_the_body_field_sets_the_class_and_the_header_wins(topo: Topology, route: str) -> None:
    body = BODIES[route]
    # The field alone: high is refused on these routes, low is let through.
    assert _refused_for_priority(*_post(topo, route, {**body, "priority": "high"}))
    status, answer = _post(topo, route, {**body, "priority": "low"})
    assert status in (503, 504) and not _refused_for_priority(status, answer), answer
    # Both given: the header wins, either way.
    assert _refused_for_priority(*_post(topo, route, {**body, "priority": "low"}, header="high"))
    status, answer = _post(topo, route, {**body, "priority": "high"}, header="low")
    assert status in (503, 504) and not _refused_for_priority(status, answer), answer


@pytest.mark.parametrize("route", ROUTES)
def test_a_bad_priority_field_is_a_400_naming_it(topo: Topology, route: str) -> None:
    body = BODIES.get(route, {"prompt": "hi"})
    status, answer = _post(topo, route, {**body, "priority": "urgent"})
    error = answer["error"]
    assert status == 400 and isinstance(error, dict), answer
    assert "priority" in error["message"] and "urgent" in error["message"], error
