"""Fixtures for the configs tests: YAML files in a temporary folder and a small pipeline."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec, StageSpec

from .helpers import WriteYaml


@pytest.fixture
def write_yaml(tmp_path: Path) -> WriteYaml:
    """Write dedented YAML text to ``tmp_path/<name>`` and return the path."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def chain3() -> PipelineSpec:
    """A qwen3-omni-like chain: 0 -> 1 -> 2 (not registered)."""
    return PipelineSpec(
        name="chain3",
        stages=(
            StageSpec(stage_id=0, name="thinker", engine="m:A", final_output=OutputKind.TEXT),
            StageSpec(stage_id=1, name="talker", engine="m:B", sources=(0,)),
            StageSpec(
                stage_id=2,
                name="code2wav",
                engine="m:C",
                sources=(1,),
                final_output=OutputKind.AUDIO,
            ),
        ),
    )


@pytest.fixture
def fork() -> PipelineSpec:
    """A DAG where stage 0 feeds stages 1 and 2."""
    return PipelineSpec(
        name="fork",
        stages=(
            StageSpec(stage_id=0, name="a", engine="m:A"),
            StageSpec(stage_id=1, name="b", engine="m:B", sources=(0,), final_output="text"),
            StageSpec(stage_id=2, name="c", engine="m:C", sources=(0,), final_output="audio"),
        ),
    )
