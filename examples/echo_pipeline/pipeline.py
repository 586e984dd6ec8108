"""Registers the ``echo`` pipeline: ``shout`` (upper-cases the prompt) -> ``echo`` (repeats it).

Import this module to register the pipeline: ``--pipeline-module examples.echo_pipeline.pipeline``
on ``omni-stage``, ``omni-up`` and ``omni-run``, or ``OMNI_PIPELINE_MODULES``, or the
``omni_mesh.pipelines`` entry-point group of an installed package. The engine processes import
it too, so the engine classes and the processor below are found by their ``module:name`` paths.
"""

from __future__ import annotations

from omni_mesh.api import OutputKind, PipelineSpec, StageData, StageSpec, register_pipeline

_HERE = "examples.echo_pipeline"

ECHO = register_pipeline(
    PipelineSpec(
        name="echo",
        description="Example user pipeline: shout (upper-case) -> echo (repeat max_tokens times).",
        prompt_fields=("seed", "max_tokens"),
        stages=(
            StageSpec(stage_id=0, name="shout", engine=f"{_HERE}.engine:ShoutEngine"),
            StageSpec(
                stage_id=1,
                name="echo",
                engine=f"{_HERE}.engine:EchoEngine",
                sources=(0,),
                processor=f"{_HERE}.pipeline:shout_to_echo",
                final_output=OutputKind.TEXT,
            ),
        ),
    )
)


def shout_to_echo(data: StageData) -> StageData:
    """Stage 0 -> stage 1: only the shouted text and the repeat count (``max_tokens``)."""
    return StageData(
        fields={k: v for k, v in data.fields.items() if k in ("shouted", "max_tokens")}
    )
