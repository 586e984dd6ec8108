"""Pipeline definitions: the fixed stage topology of a model, as frozen, validated Python objects.

A pipeline is a DAG of stages. Each stage names its engine class (``"module:Class"``), the stages
it takes input from, an optional processor (``"module:function"``) that turns its sources'
outputs into its own input, and whether its output is part of the final answer. Pipelines are
registered by name (:mod:`omni_mesh.configs.registry`; the built-in ones are
:mod:`omni_mesh.configs.pipelines`) and are never read from YAML.

A stage with several sources is a *join*: it runs once per request with every source's output.
Its *collector* (:meth:`PipelineSpec.join_collector`) is its immediate dominator, the last stage
every path from the entry to the join passes through: the runner executing the collector for a
request gathers the sources' inputs for the join and hands the join off once (DESIGN §4).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
ImportPath = Annotated[str, StringConstraints(pattern=_IMPORT_PATH)]
StageName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
PipelineName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9\-]{0,47}$")]

MAX_STAGES = 64


class OutputKind(StrEnum):
    """What a final stage contributes to the response."""

    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    DATA = "data"  # opaque bytes (synthetic stages)


class PipelineError(ValueError):
    """A pipeline definition is invalid or a pipeline/stage lookup failed."""


class UnknownPipelineError(PipelineError, KeyError):
    """No pipeline is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown pipeline"


class UnknownStageError(PipelineError, KeyError):
    """The pipeline has no stage with the requested id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown stage"


class StageSpec(BaseModel):
    """One stage of a pipeline: what runs there and where its input comes from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage_id: int = Field(ge=0, lt=MAX_STAGES, description="Stage id, unique in the pipeline.")
    name: StageName = Field(description="Short stage name (thinker, talker, code2wav, ar, dit).")
    engine: ImportPath = Field(description="Engine class run by this stage, as 'module:Class'.")
    sources: tuple[int, ...] = Field(
        default=(), description="Stage ids whose output feeds this stage; empty for the entry."
    )
    processor: ImportPath | None = Field(
        default=None,
        description="'module:function' turning the sources' outputs into this stage's input.",
    )
    final_output: OutputKind | None = Field(
        default=None, description="Kind of output this stage adds to the final answer, if any."
    )
    stream_input: bool = Field(
        default=False,
        description="Under async_chunk, the stage takes its source's chunks as one request "
        "whose input grows (its engine starts on the first chunk), not one request per chunk.",
    )


class PipelineSpec(BaseModel):
    """A frozen, validated stage DAG."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: PipelineName = Field(description="Registry name of the pipeline.")
    description: str = Field(default="", max_length=400, description="One-line summary.")
    stages: tuple[StageSpec, ...] = Field(min_length=1, max_length=MAX_STAGES)
    prompt_fields: tuple[str, ...] = Field(
        default=("seed",),
        description="Optional prompt fields the entry stage accepts besides 'prompt'.",
    )
    input_audio: bool = Field(
        default=False,
        description="The entry stage reads audio parts (input_audio) of chat messages.",
    )

    @model_validator(mode="after")
    def _check_dag(self) -> PipelineSpec:
        ids = [s.stage_id for s in self.stages]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"pipeline {self.name!r}: duplicate stage ids {dupes}")
        known = set(ids)
        for stage in self.stages:
            unknown = sorted(set(stage.sources) - known)
            if unknown:
                raise ValueError(
                    f"pipeline {self.name!r}: stage {stage.stage_id} ({stage.name}) "
                    f"has unknown source stage(s) {unknown}"
                )
            if stage.stage_id in stage.sources:
                raise ValueError(
                    f"pipeline {self.name!r}: stage {stage.stage_id} lists itself as a source"
                )
            _check_join_sources(self, stage)
            if stage.stream_input and len(stage.sources) != 1:
                raise ValueError(
                    f"pipeline {self.name!r}: stage {stage.stage_id} ({stage.name}) has "
                    "stream_input, which needs exactly one source stage"
                )
        entries = [s.stage_id for s in self.stages if not s.sources]
        if len(entries) != 1:
            raise ValueError(
                f"pipeline {self.name!r}: needs exactly one entry stage (no sources), "
                f"found {entries or 'none'}"
            )
        if not any(s.final_output for s in self.stages):
            raise ValueError(f"pipeline {self.name!r}: no stage has a final_output")
        _topological_order(self.stages, self.name)
        return self

    # ---- lookups -------------------------------------------------------------------------

    @property
    def stage_ids(self) -> frozenset[int]:
        return frozenset(s.stage_id for s in self.stages)

    @property
    def entry_stage_id(self) -> int:
        return next(s.stage_id for s in self.stages if not s.sources)

    @property
    def final_stage_ids(self) -> tuple[int, ...]:
        return tuple(s.stage_id for s in self.stages if s.final_output is not None)

    def stage(self, stage_id: int) -> StageSpec:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise UnknownStageError(
            f"pipeline {self.name!r} has no stage {stage_id} (stages: {sorted(self.stage_ids)})"
        )

    def downstream(self, stage_id: int) -> tuple[int, ...]:
        """Stage ids fed by ``stage_id``, in id order."""
        self.stage(stage_id)
        return tuple(sorted(s.stage_id for s in self.stages if stage_id in s.sources))

    def topological_order(self) -> tuple[int, ...]:
        return _topological_order(self.stages, self.name)

    def has_edge(self, from_stage: int, to_stage: int) -> bool:
        return to_stage in self.stage_ids and from_stage in self.stage(to_stage).sources

    # ---- joins -----------------------------------------------------------------------------

    @property
    def join_stage_ids(self) -> tuple[int, ...]:
        """Stages with several sources (joins), in id order."""
        return tuple(sorted(s.stage_id for s in self.stages if len(s.sources) > 1))

    def is_join(self, stage_id: int) -> bool:
        return len(self.stage(stage_id).sources) > 1

    def join_collector(self, stage_id: int) -> int:
        """The stage whose runner collects the join ``stage_id``'s inputs: its immediate
        dominator (every path from the entry to the join passes through it, and it is the last
        such stage). :class:`PipelineError` when ``stage_id`` is not a join."""
        if not self.is_join(stage_id):
            raise PipelineError(
                f"pipeline {self.name!r}: stage {stage_id} has one source; it is not a join"
            )
        return _immediate_dominators(self)[stage_id]

    def join_collectors(self) -> dict[int, int]:
        """Join stage id -> its collector stage id, for every join of the pipeline."""
        idom = _immediate_dominators(self)
        return {j: idom[j] for j in self.join_stage_ids}


def _topological_order(stages: Iterable[StageSpec], pipeline: str) -> tuple[int, ...]:
    """Kahn's algorithm; raises on a cycle, naming the stages involved."""
    stages = list(stages)
    indegree = {s.stage_id: len(set(s.sources)) for s in stages}
    order: list[int] = []
    ready = sorted(i for i, d in indegree.items() if d == 0)
    while ready:
        current = ready.pop(0)
        order.append(current)
        for s in stages:
            if current in s.sources:
                indegree[s.stage_id] -= 1
                if indegree[s.stage_id] == 0:
                    ready.append(s.stage_id)
        ready.sort()
    if len(order) != len(indegree):
        cyclic = sorted(set(indegree) - set(order))
        raise ValueError(f"pipeline {pipeline!r}: cycle among stages {cyclic}")
    return tuple(order)


def _check_join_sources(spec: PipelineSpec, stage: StageSpec) -> None:
    """A join's input names each source's fields ``<source name>.<name>``: its sources must be
    listed once each and have distinct names."""
    if len(set(stage.sources)) != len(stage.sources):
        raise ValueError(
            f"pipeline {spec.name!r}: stage {stage.stage_id} ({stage.name}) lists a source "
            f"more than once: {list(stage.sources)}"
        )
    if len(stage.sources) < 2:
        return
    names = [s.name for s in spec.stages if s.stage_id in stage.sources]
    if len(set(names)) != len(names):
        raise ValueError(
            f"pipeline {spec.name!r}: join stage {stage.stage_id} ({stage.name}) has sources "
            f"with the same name ({sorted(names)}); a join names its inputs by source name"
        )


def _immediate_dominators(spec: PipelineSpec) -> dict[int, int]:
    """Stage id -> its immediate dominator (the entry maps to itself). In a DAG, the
    dominators of a stage are itself plus those common to all its sources; they form a chain,
    and the immediate one is the latest of them in topological order."""
    order = spec.topological_order()
    position = {stage_id: i for i, stage_id in enumerate(order)}
    doms: dict[int, frozenset[int]] = {}
    idom: dict[int, int] = {}
    for stage_id in order:
        sources = spec.stage(stage_id).sources
        if not sources:
            doms[stage_id], idom[stage_id] = frozenset({stage_id}), stage_id
            continue
        common = frozenset.intersection(*(doms[s] for s in sources))
        doms[stage_id] = common | {stage_id}
        idom[stage_id] = max(common, key=position.__getitem__)
    return idom


def is_valid_name(name: str) -> bool:
    return re.fullmatch(r"^[a-z][a-z0-9\-]{0,47}$", name) is not None
