"""PipelineSpec validation: the DAG must have one entry, a final stage, no cycle, known sources."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from omni_mesh.configs.pipeline_spec import (
    PipelineSpec,
    StageSpec,
    UnknownPipelineError,
    UnknownStageError,
)
from omni_mesh.configs.registry import get_pipeline, list_pipelines

pytestmark = pytest.mark.unit


def _stage(stage_id: int, *sources: int, final: str | None = None) -> dict[str, Any]:
    return {
        "stage_id": stage_id,
        "name": f"s{stage_id}",
        "engine": "m:E",
        "sources": sources,
        "final_output": final,
    }


def _spec(*stages: dict[str, Any]) -> PipelineSpec:
    return PipelineSpec.model_validate({"name": "p", "stages": stages})


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        ((_stage(0, 1), _stage(1, 0, final="text")), "needs exactly one entry stage"),
        ((_stage(0), _stage(1, final="text"), _stage(2, 0)), r"found \[0, 1\]"),
        ((_stage(0), _stage(1, 0)), "no stage has a final_output"),
        ((_stage(0), _stage(1, 0, 2), _stage(2, 1, final="audio")), r"cycle among stages \[1, 2\]"),
        (
            (_stage(0), _stage(1, 7, final="text")),
            r"stage 1 \(s1\) has unknown source stage\(s\) \[7\]",
        ),
        ((_stage(0), _stage(0, final="text")), r"duplicate stage ids \[0\]"),
        ((_stage(0), _stage(1, 1, final="text")), "stage 1 lists itself as a source"),
    ],
)
def test_invalid_pipelines(stages: tuple[dict[str, Any], ...], expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        _spec(*stages)


@pytest.mark.parametrize(
    ("field", "value"),
    [("engine", "no-colon"), ("name", "Thinker"), ("stage_id", 64), ("processor", "x")],
)
def test_invalid_stage_fields(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        StageSpec.model_validate({**_stage(0, final="text"), field: value})


def test_dag_lookups() -> None:
    spec = _spec(_stage(0, final="text"), _stage(1, 0), _stage(2, 0, 1, final="audio"))
    assert spec.entry_stage_id == 0 and spec.final_stage_ids == (0, 2)
    assert spec.downstream(0) == (1, 2) and spec.topological_order() == (0, 1, 2)
    assert spec.has_edge(1, 2) and not spec.has_edge(2, 1) and not spec.has_edge(0, 9)
    with pytest.raises(UnknownStageError, match="no stage 5"):
        spec.stage(5)


def test_registry() -> None:
    assert {"tiny-omni", "tiny-tts", "tiny-image", "synthetic"} <= set(list_pipelines())
    assert get_pipeline("tiny-tts").stage(1).name == "code2wav"
    with pytest.raises(UnknownPipelineError, match="unknown pipeline 'nope'"):
        get_pipeline("nope")
