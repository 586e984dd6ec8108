"""``/v1/run`` across a join, by hand, through real pods (synthetic-diamond): the branching call
answers ``next`` for both branches, each branch answers an input for the join, and the join call
takes both as ``stage_inputs`` (any order), on the API server or on a replica of the join. The
400s: an input missing, one given twice, one of another request, ``stage_input`` for a join,
``stage_inputs`` for a single-source stage. omni-run's DAG walk is in tests/run_client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sidecar.joins import expected_s3, from_output
from tests.sidecar.topology import Topology, post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def diamond(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    before = shm_segments()
    topo = Topology("synthetic-diamond", [1, 1, 1, 1], tmp_path_factory.mktemp("diamond-run"))
    try:
        topo.start()
        topo.wait_discovered(3, 1)
        yield topo
    finally:
        topo.close()
    assert shm_segments() - before == set(), "shared-memory segments leaked"


def _run(url: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    got, raw = post_json(url + "/v1/run", body)
    assert got == status, raw
    answer: dict[str, Any] = json.loads(raw)
    return answer


def _branch_inputs(topo: Topology, seed: int) -> dict[int, str]:
    """Stage 0 on the API server, then each branch: the join inputs by source stage."""
    first = _run(topo.api_url, {"stage_id": 0, "stage_input": {"prompt": "r", "seed": seed}})
    assert sorted(n["stage_id"] for n in first["next"]) == [1, 2]
    inputs = {}
    for n in first["next"]:
        answer = _run(topo.api_url, n)
        assert answer["next_stage_id"] == 3
        inputs[n["stage_id"]] = answer["stage_input"]
    return inputs


def test_join_call_takes_one_input_per_source_in_any_order(diamond: Topology) -> None:
    inputs = _branch_inputs(diamond, 5)
    for order, url in (([1, 2], diamond.api_url), ([2, 1], diamond.urls[3][0])):
        answer = _run(url, {"stage_id": 3, "stage_inputs": [inputs[s] for s in order]})
        assert from_output(answer["output"]) == expected_s3(5)
        assert "next" not in answer and "stage_input" not in answer


def test_bad_join_calls_are_400s_naming_what_is_wrong(diamond: Topology) -> None:
    inputs = _branch_inputs(diamond, 6)
    other = _branch_inputs(diamond, 7)
    cases = [
        ({"stage_inputs": [inputs[1]]}, "is a join of stages [1, 2]: no input from stage(s) [2]"),
        ({"stage_inputs": [inputs[1], inputs[1]]}, "stage_inputs[1]: a second input from stage 1"),
        ({"stage_inputs": [inputs[1], other[2]]}, "stage 2's is for request"),
        ({"stage_input": inputs[1]}, "send stage_inputs, one opaque input per source"),
        (
            {"stage_inputs": [inputs[1], inputs[2]], "stage_input": inputs[1]},
            "send stage_inputs only",
        ),
        ({"stage_inputs": [inputs[1], "bm90IGFuIGVudmVsb3Bl"]}, "stage_inputs[1]: "),
    ]
    for url in (diamond.api_url, diamond.urls[3][0]):
        for body, message in cases:
            error = _run(url, {"stage_id": 3, **body}, status=400)["error"]
            assert message in error["message"], (body, error)
    error = _run(diamond.api_url, {"stage_id": 1, "stage_inputs": [inputs[1]]}, 400)["error"]
    assert "stage 1 has one source" in error["message"]
