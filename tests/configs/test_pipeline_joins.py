"""Join stages in a pipeline definition: the collector (immediate dominator) of each join, the
checks on a join's sources, and async_chunk refused for a pipeline with a join."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from omni_mesh.configs.loader import DeployConfigError, load_deploy_config
from omni_mesh.configs.pipeline_spec import PipelineError, PipelineSpec
from omni_mesh.configs.registry import get_pipeline

pytestmark = pytest.mark.unit


def _stage(stage_id: int, *sources: int, name: str | None = None) -> dict[str, Any]:
    return {
        "stage_id": stage_id,
        "name": name or f"s{stage_id}",
        "engine": "m:E",
        "sources": sources,
        "final_output": "data" if stage_id == 9 else None,
    }


def _spec(*stages: dict[str, Any]) -> PipelineSpec:
    return PipelineSpec.model_validate({"name": "p", "stages": stages})


def test_diamond_collector_is_the_branching_stage() -> None:
    spec = get_pipeline("synthetic-diamond")
    assert spec.join_stage_ids == (3,)
    assert spec.is_join(3) and not spec.is_join(1)
    assert spec.join_collector(3) == 0
    assert spec.join_collectors() == {3: 0}


@pytest.mark.parametrize(
    ("stages", "collectors"),
    [
        # a source that is also the collector: 0 -> (1, 9), 1 -> 9
        ((_stage(0), _stage(1, 0), _stage(9, 0, 1)), {9: 0}),
        # the diamond after a chain: 0 -> 1 -> (2, 3) -> 9
        ((_stage(0), _stage(1, 0), _stage(2, 1), _stage(3, 1), _stage(9, 2, 3)), {9: 1}),
        # nested: 0 -> (1, 2); 1 -> (3, 4) -> 5; (5, 2) -> 9
        (
            (
                _stage(0),
                _stage(1, 0),
                _stage(2, 0),
                _stage(3, 1),
                _stage(4, 1),
                _stage(5, 3, 4),
                _stage(9, 5, 2),
            ),
            {5: 1, 9: 0},
        ),
        # three sources, one of them a long branch: 0 -> (1, 2, 3), 3 -> 4; (1, 2, 4) -> 9
        (
            (_stage(0), _stage(1, 0), _stage(2, 0), _stage(3, 0), _stage(4, 3), _stage(9, 1, 2, 4)),
            {9: 0},
        ),
    ],
)
def test_collector_is_the_immediate_dominator(
    stages: tuple[dict[str, Any], ...], collectors: dict[int, int]
) -> None:
    assert _spec(*stages).join_collectors() == collectors


def test_collector_of_a_single_source_stage_is_an_error() -> None:
    with pytest.raises(PipelineError, match="stage 1 has one source; it is not a join"):
        get_pipeline("synthetic-diamond").join_collector(1)


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        (
            (_stage(0), _stage(1, 0), _stage(9, 1, 1)),
            r"stage 9 \(s9\) lists a source more than once: \[1, 1\]",
        ),
        (
            (_stage(0), _stage(1, 0, name="x"), _stage(2, 0, name="x"), _stage(9, 1, 2)),
            r"join stage 9 \(s9\) has sources with the same name",
        ),
    ],
)
def test_bad_join_sources(stages: tuple[dict[str, Any], ...], expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        _spec(*stages)


def test_async_chunk_is_refused_for_a_pipeline_with_a_join() -> None:
    spec = get_pipeline("synthetic-diamond")
    assert load_deploy_config(None, spec).async_chunk is False
    with pytest.raises(DeployConfigError) as err:
        load_deploy_config(None, spec, cli_overrides={"async_chunk": True})
    message = str(err.value)
    assert "pipeline 'synthetic-diamond' cannot stream chunks (async_chunk: true)" in message
    assert "stage 3 (s3) is a join of stages [1, 2]" in message
    assert len(message.splitlines()) == 1


def test_async_chunk_stays_allowed_without_joins() -> None:
    assert load_deploy_config(
        None, get_pipeline("synthetic"), cli_overrides={"async_chunk": True}
    ).async_chunk
