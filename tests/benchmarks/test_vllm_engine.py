"""The pure helpers of the in-process vLLM engine benchmark: the plan's syntax, a request's
figures from its step times, and the child's JSON line read back as phases."""

from __future__ import annotations

import pytest

from benchmarks.vllm import ENGINE, phases_from_json
from benchmarks.vllm_engine import Timeline, parse_plan

pytestmark = pytest.mark.unit


def test_plan_parses_and_rejects_bad_entries() -> None:
    assert parse_plan("1:20,16:96") == [(1, 20), (16, 96)]
    for bad in ("16", "0:5", "a:3", "2:"):
        with pytest.raises(ValueError):
            parse_plan(bad)


def test_timeline_figures_count_only_steps_with_tokens() -> None:
    t = Timeline(added=1.0)
    t.record(1.5, 1)
    t.record(1.6, 0)  # a step that gave this request nothing
    t.record(1.7, 1)
    t.record(1.9, 2)
    ttft, itl, tokens = t.figures()
    assert ttft == pytest.approx(0.5) and tokens == 4
    assert itl == pytest.approx(0.4 / 3)
    with pytest.raises(RuntimeError):
        Timeline(added=0.0).figures()


def test_phases_from_the_child_json_line() -> None:
    streams = "[[0.1, null, 1], [0.2, 0.01, 63]]"
    line = '{"phases": [{"concurrency": 16, "wall_s": 2.0, "streams": ' + streams + "}]}"
    (phase,) = phases_from_json(line)
    assert phase.server == ENGINE and phase.concurrency == 16
    assert phase.tokens_per_s == pytest.approx(32.0)
    assert phase.itl == pytest.approx(0.01)
