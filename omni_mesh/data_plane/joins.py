"""The input of a join stage (a stage with several sources), built from one input per source.

A join runs once per request with every source's output (DESIGN §4). Its :class:`StageInput`
is self-contained like any other (invariant 1): one payload holding each source's fields and
tensors under ``<source stage name>.<name>``, in the order the pipeline lists the sources, so
it never depends on which source arrived first. Its ``from_stage`` is the join's first source
(the edge whose connector carries it), its chunk is 0 and it is whole.

The orchestrated path (the collector stage's runner) and ``/v1/run`` (a join call's
``stage_inputs``) both build it with :func:`join_input`; the engine process splits it back per
source for a processor with :func:`split_join`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane.messages import Payload, Scalar, StageInput, is_whole

SEPARATOR = "."
T = TypeVar("T")


class JoinInputError(ValueError):
    """The inputs given for a join do not fit it; the message says what is wrong."""


def join_input(
    pipeline: PipelineSpec, stage_id: int, inputs: Mapping[int, StageInput]
) -> StageInput:
    """The join ``stage_id``'s input from ``inputs`` (source stage id -> that source's input
    for the join, tensors inline or in shared memory alike). Every source exactly once, one
    request, whole inputs: :class:`JoinInputError` otherwise."""
    stage = pipeline.stage(stage_id)
    missing = [s for s in stage.sources if s not in inputs]
    foreign = sorted(set(inputs) - set(stage.sources))
    if foreign:
        raise JoinInputError(
            f"stage {stage_id} ({stage.name}) takes input from stages "
            f"{list(stage.sources)}, not from stage(s) {foreign}"
        )
    if missing:
        raise JoinInputError(
            f"stage {stage_id} ({stage.name}) is a join of stages {list(stage.sources)}: "
            f"no input from stage(s) {missing}"
        )
    ordered = [inputs[s] for s in stage.sources]
    first = ordered[0]
    for source, si in zip(stage.sources, ordered, strict=True):
        if si.stage_id != stage_id or si.from_stage != source:
            raise JoinInputError(
                f"the input given as stage {source}'s is from stage {si.from_stage} "
                f"for stage {si.stage_id}"
            )
        if si.request_id != first.request_id:
            raise JoinInputError(
                f"inputs of one request expected: stage {source}'s is for request "
                f"{si.request_id!r}, stage {stage.sources[0]}'s for {first.request_id!r}"
            )
        if not is_whole(si):
            raise JoinInputError(
                f"stage {source}'s input is chunk {si.chunk} of a stream; a join takes whole "
                "inputs (async_chunk is refused for pipelines with joins)"
            )
    fields: dict[str, Scalar] = {}
    tensors = {}
    for source, si in zip(stage.sources, ordered, strict=True):
        prefix = pipeline.stage(source).name + SEPARATOR
        fields.update({prefix + k: v for k, v in si.payload.fields.items()})
        tensors.update({prefix + k: t for k, t in si.payload.tensors.items()})
    # The request's own fields (seed, sampling, trace, …) are the same in every source's input.
    return msgspec.structs.replace(
        first,
        stage_id=stage_id,
        from_stage=stage.sources[0],
        chunk=0,
        last=True,
        attempt=0,
        deadline_ms=min(si.deadline_ms for si in ordered),
        payload=Payload(fields=fields, tensors=tensors),
    )


def split_join(
    pipeline: PipelineSpec, stage_id: int, named: Mapping[str, T]
) -> dict[str, dict[str, T]]:
    """A join's ``<source name>.<name>`` entries (fields or arrays) as source name -> {name:
    entry}; every source present, even one without entries. A name without a known source
    prefix is a :class:`JoinInputError`."""
    sources = [pipeline.stage(s).name for s in pipeline.stage(stage_id).sources]
    split: dict[str, dict[str, T]] = {name: {} for name in sources}
    for key, value in named.items():
        source, sep, name = key.partition(SEPARATOR)
        if not sep or source not in split:
            raise JoinInputError(
                f"stage {stage_id}: input {key!r} does not name one of the join's sources "
                f"({', '.join(sources)}) as '<source>.<name>'"
            )
        split[source][name] = value
    return split
