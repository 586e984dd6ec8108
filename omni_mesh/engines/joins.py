"""A join stage's engine input (a stage with several sources; ``data_plane/joins.py``).

The join's :class:`StageInput` holds every source's fields and arrays named
``<source stage name>.<name>``. Without a processor the engine sees exactly that. With one, the
processor (the join stage's ``processor``, run in the join's engine process because only there
are all sources' outputs together) receives source name -> that source's output and returns the
engine's input: it may combine them. A source's processor is never applied to its output for a
join: the join's processor sees the raw outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from omni_mesh.configs.pipeline_spec import PipelineSpec, StageSpec
from omni_mesh.data_plane.joins import JoinInputError, split_join
from omni_mesh.engines.base import EngineInputError, StageData, import_object

#: A join stage's processor: source stage name -> its output, in the pipeline's source order.
JoinProcessor = Callable[[Mapping[str, StageData]], StageData]


class JoinAssembler:
    """Turns a join stage's raw input data into its engine's input (see the module doc)."""

    def __init__(self, pipeline: PipelineSpec, stage: StageSpec) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.processor: JoinProcessor | None = (
            import_object(stage.processor) if stage.processor else None
        )

    def __call__(self, data: StageData) -> StageData:
        if self.processor is None:
            return data
        sid = self.stage.stage_id
        try:
            fields = split_join(self.pipeline, sid, data.fields)
            arrays = split_join(self.pipeline, sid, data.arrays)
        except JoinInputError as exc:
            raise EngineInputError(str(exc)) from None
        outputs = {name: StageData(fields=fields[name], arrays=arrays[name]) for name in fields}
        try:
            return self.processor(outputs)
        except Exception as exc:  # a processor bug fails its request, never the engine
            raise JoinProcessorError(
                f"processor for join stage {sid}: {type(exc).__name__}: {exc}"
            ) from exc


class JoinProcessorError(RuntimeError):
    """A join stage's processor raised: the request fails (``engine_error``)."""


def join_assembler(pipeline: PipelineSpec, stage: StageSpec) -> JoinAssembler | None:
    """The assembler of ``stage`` when it is a join; None for a single-source stage."""
    return JoinAssembler(pipeline, stage) if len(stage.sources) > 1 else None
