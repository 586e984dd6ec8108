"""Cross-field checks of a :class:`~omni_mesh.configs.deploy.DeployConfig`: connector references,
edge disagreements, device counts, duplicate stage ids and (given the pipeline) stages and edges
that are not in its DAG. Each check returns :class:`ConfigIssue` s; none raises."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from omni_mesh.configs.deploy_fields import edge_stage
from omni_mesh.configs.errors import ConfigIssue
from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.configs.stage_deploy import StageDeployConfig


class StageList(Protocol):
    """A platform section: the stage entries it overrides."""

    @property
    def stages(self) -> Sequence[StageDeployConfig]: ...


class CheckedConfig(Protocol):
    """What the checks read of a :class:`~omni_mesh.configs.deploy.DeployConfig` (which
    imports this module, so the checks see the whole config through this protocol)."""

    @property
    def stages(self) -> Sequence[StageDeployConfig]: ...
    @property
    def platforms(self) -> Mapping[str, StageList]: ...
    @property
    def connectors(self) -> Mapping[str, object]: ...
    @property
    def async_chunk(self) -> bool: ...


__all__ = ["config_problems", "disagreement", "duplicate_ids"]


def config_problems(cfg: CheckedConfig, pipeline: PipelineSpec | None = None) -> list[ConfigIssue]:
    """Every cross-field problem of ``cfg``; empty when it is consistent."""
    issues = duplicate_ids(cfg.stages, "stages")
    for name, section in cfg.platforms.items():
        for s in section.stages:
            issues += _stage_refs(cfg, s, f"platforms.{name}.stages", pipeline)
    for s in cfg.stages:
        issues += _stage_refs(cfg, s, "stages", pipeline)
        issues += _stage_sizes(s)
    issues += _disagreements(cfg)
    if pipeline is not None and cfg.async_chunk:
        issues += _chunked_joins(pipeline)
    return issues


def duplicate_ids(stages: Sequence[StageDeployConfig], prefix: str) -> list[ConfigIssue]:
    ids = [s.stage_id for s in stages]
    return [
        ConfigIssue(f"{prefix}[stage_id={i}]", f"stage {i} is listed more than once", i, "stage_id")
        for i in sorted({i for i in ids if ids.count(i) > 1})
    ]


def disagreement(from_stage: int, to_stage: int, out: str, inp: str) -> ConfigIssue:
    return ConfigIssue(
        f"stages[stage_id={to_stage}].input_connectors.from_stage_{from_stage}",
        f"edge {from_stage} -> {to_stage}: receiver names connector {inp!r} but sender stage "
        f"{from_stage} names {out!r} in output_connectors.to_stage_{to_stage}; use one connector",
        to_stage,
        "input_connectors",
    )


def _stage_refs(
    cfg: CheckedConfig, s: StageDeployConfig, prefix: str, pipeline: PipelineSpec | None
) -> list[ConfigIssue]:
    where = f"{prefix}[stage_id={s.stage_id}]"
    if pipeline is not None and s.stage_id not in pipeline.stage_ids:
        known = ", ".join(str(i) for i in sorted(pipeline.stage_ids))
        msg = f"stage {s.stage_id} is not in pipeline {pipeline.name!r} (stages: {known})"
        return [ConfigIssue(where, msg, s.stage_id, "stage_id")]
    issues: list[ConfigIssue] = []
    for field, table in (
        ("input_connectors", s.input_connectors),
        ("output_connectors", s.output_connectors),
    ):
        for key, ref in table.items():
            path = f"{where}.{field}.{key}"
            if ref not in cfg.connectors:
                defined = ", ".join(sorted(cfg.connectors)) or "none"
                msg = f"connector {ref!r} is not defined in connectors (defined: {defined})"
                issues.append(ConfigIssue(path, msg, s.stage_id, field))
            if pipeline is not None:
                issues += _edge_issue(pipeline, s.stage_id, field, key, path)
    return issues


def _disagreements(cfg: CheckedConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    by_id = {s.stage_id: s for s in cfg.stages}
    for sender in cfg.stages:
        for key, out in sender.output_connectors.items():
            to_stage = edge_stage(key)
            receiver = by_id.get(to_stage)
            inp = receiver.input_connector(sender.stage_id) if receiver else None
            if inp and inp != out:
                issues.append(disagreement(sender.stage_id, to_stage, out, inp))
    return issues


def _chunked_joins(pipeline: PipelineSpec) -> list[ConfigIssue]:
    """``async_chunk`` cannot be served with a join: its sources would stream chunks that it
    could join only if they chunked identically, which nothing guarantees."""
    issues = []
    for j in pipeline.join_stage_ids:
        stage = pipeline.stage(j)
        msg = (
            f"pipeline {pipeline.name!r} cannot stream chunks (async_chunk: true): stage {j} "
            f"({stage.name}) is a join of stages {list(stage.sources)}, and a join takes whole "
            "inputs; set async_chunk: false"
        )
        issues.append(ConfigIssue("async_chunk", msg, j, "async_chunk"))
    return issues[:1]


def _stage_sizes(s: StageDeployConfig) -> list[ConfigIssue]:
    where = f"stages[stage_id={s.stage_id}]"
    issues: list[ConfigIssue] = []
    dp_local = s.data_parallel_size_local
    if dp_local is not None and dp_local > s.data_parallel_size:
        msg = f"{dp_local} exceeds data_parallel_size {s.data_parallel_size} of stage {s.stage_id}"
        issues.append(
            ConfigIssue(
                f"{where}.data_parallel_size_local", msg, s.stage_id, "data_parallel_size_local"
            )
        )
    slots = s.device_slots  # an autoscaled pool needs devices for its largest size
    if s.devices is not None and len(s.device_ids) != s.world_size * slots:
        need = s.world_size * slots
        pool_field = "autoscale.max_replicas" if s.autoscale else "num_replicas"
        pool = f"{pool_field} {s.max_pool_size}"
        if s.autoscale and s.autoscale.standby_replicas:
            pool += f" + autoscale.standby_replicas {s.autoscale.standby_replicas}"
        if s.prefill and s.prefill.autoscale:
            pool += f" + prefill.autoscale.max_replicas {s.prefill.autoscale.max_replicas}"
            if s.prefill.autoscale.standby_replicas:
                standby = s.prefill.autoscale.standby_replicas
                pool += f" + prefill.autoscale.standby_replicas {standby}"
        elif s.prefill:
            pool += f" + prefill.num_replicas {s.prefill.num_replicas}"
        if slots != s.max_pool_size:
            pool = f"({pool})"
        msg = (
            f"stage {s.stage_id} lists {len(s.device_ids)} device(s) ({s.devices!r}) but needs "
            f"{need} = world_size {s.world_size} (tp {s.tensor_parallel_size} x dp "
            f"{dp_local or s.data_parallel_size} x pp {s.pipeline_parallel_size}) x {pool}"
            f"; set tensor_parallel_size and devices together for this stage "
            f'with --stage-overrides \'{{"{s.stage_id}": {{"tensor_parallel_size": T, '
            f'"devices": "<T x num_replicas ids>"}}}}\''
        )
        issues.append(ConfigIssue(f"{where}.devices", msg, s.stage_id, "devices"))
    return issues


def _edge_issue(
    pipeline: PipelineSpec, stage_id: int, field: str, key: str, path: str
) -> list[ConfigIssue]:
    other = edge_stage(key)
    incoming = field == "input_connectors"
    src, dst = (other, stage_id) if incoming else (stage_id, other)
    if pipeline.has_edge(src, dst):
        return []
    if incoming:
        peers = pipeline.stage(stage_id).sources
        hint = f"stage {stage_id} takes input from: {', '.join(map(str, peers)) or 'none'}"
    else:
        peers = pipeline.downstream(stage_id)
        hint = f"stage {stage_id} feeds: {', '.join(map(str, peers)) or 'none'}"
    msg = f"pipeline {pipeline.name!r} has no edge {src} -> {dst} ({hint})"
    return [ConfigIssue(path, msg, stage_id, field)]
