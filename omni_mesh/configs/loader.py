"""Load a deploy config: YAML with ``base_config:`` overlays, a platform section, command-line
flags and ``--stage-overrides``, merged into one validated :class:`DeployConfig`.

Precedence, highest first: ``--stage-overrides`` JSON > explicit CLI flags > environment
(``OMNI_STAGE_<FIELD>``) > platform section > overlay YAML > base YAML > defaults. Stages merge
by ``stage_id``, mappings merge deeply, lists replace. Every layer is validated on its own first,
so an error names the file (or flag) that holds the bad value, the field path and the stage.

Parsing lives in :mod:`~omni_mesh.configs.yaml_io`, merging in :mod:`~omni_mesh.configs.merge`
and error conversion in :mod:`~omni_mesh.configs.errors`; their public names are re-exported here.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from omni_mesh.configs.deploy import (
    DEFAULT_CONNECTOR,
    PIPELINE_ONLY_KEYS,
    DeployConfig,
    StageDeployConfig,
)
from omni_mesh.configs.errors import (
    MAX_ISSUES,
    ConfigIssue,
    DeployConfigError,
    issues_from_validation,
)
from omni_mesh.configs.merge import MergedLayers, Raw
from omni_mesh.configs.pipeline_spec import PipelineSpec, is_valid_name
from omni_mesh.configs.yaml_io import (
    MAX_OVERRIDES_BYTES,
    MAX_YAML_BYTES,
    MAX_YAML_NODES,
    parse_json_bounded,
    read_yaml,
)

__all__ = [
    "BUNDLED_DIR",
    "CLI_SOURCE",
    "ENV_SOURCE",
    "MAX_BASE_DEPTH",
    "MAX_ISSUES",
    "MAX_OVERRIDES_BYTES",
    "MAX_YAML_BYTES",
    "MAX_YAML_NODES",
    "OVERRIDES_SOURCE",
    "ConfigIssue",
    "DeployConfigError",
    "bundled_deploy_path",
    "load_deploy_config",
    "read_yaml",
]

logger = logging.getLogger(__name__)

MAX_BASE_DEPTH = 8
BUNDLED_DIR = Path(__file__).with_name("deploy")
CLI_SOURCE = "command line"
ENV_SOURCE = "environment"
OVERRIDES_SOURCE = "--stage-overrides"

_STAGE_KEYS = frozenset(StageDeployConfig.model_fields) - {"stage_id"}
_KNOWN_KEYS = sorted(
    set(DeployConfig.model_fields) | set(StageDeployConfig.model_fields) | {"base_config"}
)


def bundled_deploy_path(pipeline_name: str) -> Path:
    """The deploy YAML shipped for ``pipeline_name`` (``omni_mesh/configs/deploy/<name>.yaml``)."""
    if not is_valid_name(pipeline_name):
        raise DeployConfigError(ConfigIssue("pipeline", f"invalid pipeline name {pipeline_name!r}"))
    path = BUNDLED_DIR / f"{pipeline_name}.yaml"
    if not path.is_file():
        msg = f"no bundled deploy config for pipeline {pipeline_name!r} (looked for {path})"
        raise DeployConfigError(ConfigIssue("", msg))
    return path


def load_deploy_config(
    path: str | Path | None,
    pipeline: PipelineSpec,
    *,
    platform: str | None = None,
    env_overrides: Mapping[str, Any] | None = None,
    cli_overrides: Mapping[str, Any] | None = None,
    cli_stage_overrides: Mapping[int, Mapping[str, Any]] | None = None,
    stage_overrides: str | Mapping[str, Mapping[str, Any]] | None = None,
    target_stages: Collection[int] | None = None,
) -> DeployConfig:
    """Merge every configuration layer for ``pipeline`` and validate the result.

    ``path=None`` loads the pipeline's bundled YAML (defaults only if it has none).
    ``env_overrides`` (the ``OMNI_STAGE_*`` variables) and ``cli_overrides`` (explicit flags)
    apply to ``target_stages`` (all stages when None); a key that is only a pipeline-wide
    setting is set at the top level. ``cli_stage_overrides`` are flags that name their stage
    (``omni-up --replicas``): they sit with the flags, below ``--stage-overrides``.
    Raises :class:`DeployConfigError`.
    """
    entry = Path(path) if path is not None else _bundled_or_none(pipeline.name)
    label = str(entry) if entry is not None else f"<defaults of {pipeline.name}>"
    merged = MergedLayers()
    if entry is not None:
        for source, layer in _read_chain(entry, label, pipeline, ()):
            merged.apply(layer, source)
    if platform:
        _apply_platform(merged, platform, label)
    targets = _targets(pipeline, target_stages)
    merged.add_missing_stages(pipeline.topological_order())
    if env_overrides:
        merged.apply(_cli_layer(env_overrides, targets, ENV_SOURCE), ENV_SOURCE)
    if cli_overrides:
        merged.apply(_cli_layer(cli_overrides, targets), CLI_SOURCE)
    for sid, values in sorted((cli_stage_overrides or {}).items()):
        merged.apply(_cli_layer(values, _targets(pipeline, [sid])), CLI_SOURCE)
    if stage_overrides is not None:
        merged.apply(_overrides_layer(stage_overrides), OVERRIDES_SOURCE)
    return _finish(merged, pipeline, label)


# ---- layers -----------------------------------------------------------------------------------


def _read_chain(
    path: Path, label: str, pipeline: PipelineSpec, seen: tuple[Path, ...]
) -> list[tuple[str, Raw]]:
    """The layers of ``path`` and its ``base_config`` ancestors, base first."""
    real = path.resolve()
    if real in seen:
        chain = " -> ".join(str(p) for p in (*seen, real))
        raise DeployConfigError(ConfigIssue("base_config", f"overlay cycle: {chain}", source=label))
    if len(seen) >= MAX_BASE_DEPTH:
        msg = f"more than {MAX_BASE_DEPTH} nested base_config overlays"
        raise DeployConfigError(ConfigIssue("base_config", msg, source=label))
    data = read_yaml(path, label)
    base = data.pop("base_config", None)
    layer = _validate_layer(data, label)
    declared = layer.get("pipeline")
    if declared is not None and declared != pipeline.name:
        msg = f"this deploy config is for pipeline {declared!r}, not {pipeline.name!r}"
        raise DeployConfigError(ConfigIssue("pipeline", msg, source=label))
    if base is None:
        return [(label, layer)]
    if not isinstance(base, str) or not base.strip():
        msg = f"must be the path of a deploy YAML, got {base!r}"
        raise DeployConfigError(ConfigIssue("base_config", msg, source=label))
    base_path = Path(base)
    if not base_path.is_absolute():
        base_path = path.parent / base_path
    if not base_path.is_file():
        msg = f"{str(base_path)!r} does not exist (a relative path resolves against {path.parent})"
        raise DeployConfigError(ConfigIssue("base_config", msg, source=label))
    base_label = os.path.normpath(base_path)  # a label only: the file is opened as written
    return [*_read_chain(base_path, base_label, pipeline, (*seen, real)), (label, layer)]


def _validate_layer(data: Mapping[str, Any], source: str) -> Raw:
    """Validate one layer on its own; return only the keys it sets, normalized.

    An overlay may change a connector's ``extra`` without repeating its ``name``: such an entry
    is validated with a stand-in name that is dropped again (the merged config must name it).
    """
    connectors = data.get("connectors")
    unnamed: list[str] = []
    if isinstance(connectors, Mapping):
        unnamed = [k for k, v in connectors.items() if isinstance(v, Mapping) and "name" not in v]
        named = {
            k: {**v, "name": DEFAULT_CONNECTOR} if k in unnamed else v
            for k, v in connectors.items()
        }
        data = {**data, "connectors": named}
    try:
        model = DeployConfig.model_validate(data, context={"layer": True})
    except ValidationError as err:
        raise DeployConfigError(issues_from_validation(err, data, source, _KNOWN_KEYS)) from None
    layer = model.model_dump(exclude_unset=True)
    for key in unnamed:
        del layer["connectors"][key]["name"]
    return layer


def _apply_platform(merged: MergedLayers, platform: str, label: str) -> None:
    section = (merged.data.get("platforms") or {}).get(platform)
    if section is None:
        logger.info(
            "deploy config %s has no platforms.%s section; using base settings", label, platform
        )
        return
    merged.apply(section, f"{label} [platforms.{platform}]")


def _targets(pipeline: PipelineSpec, target_stages: Collection[int] | None) -> list[int]:
    if target_stages is None:
        return sorted(pipeline.stage_ids)
    unknown = sorted(set(target_stages) - pipeline.stage_ids)
    if unknown:
        known = ", ".join(str(i) for i in sorted(pipeline.stage_ids))
        msg = f"stage(s) {unknown} not in pipeline {pipeline.name!r} (stages: {known})"
        raise DeployConfigError(ConfigIssue("--stage-id", msg, unknown[0], source=CLI_SOURCE))
    return sorted(set(target_stages))


def _cli_layer(overrides: Mapping[str, Any], targets: list[int], source: str = CLI_SOURCE) -> Raw:
    """Explicit flags (or their variables): stage settings go to each target stage,
    pipeline-wide ones to the top."""
    top: Raw = {}
    stage: Raw = {}
    for key, value in overrides.items():
        if key in _STAGE_KEYS or key not in PIPELINE_ONLY_KEYS:
            stage[key] = value  # unknown keys become engine_extras
        elif key in ("pipeline", "connectors", "stages", "platforms", "base_config"):
            msg = "cannot be set from a command-line flag"
            raise DeployConfigError(ConfigIssue(key, msg, source=source))
        else:
            top[key] = value
    if "stage_id" in stage:
        msg = "select stages with target_stages, not a stage_id override"
        raise DeployConfigError(ConfigIssue("stage_id", msg, source=source))
    layer: Raw = dict(top)
    if stage:
        layer["stages"] = [{**stage, "stage_id": sid} for sid in targets]
    return _validate_layer(layer, source)


def _overrides_layer(value: str | Mapping[str, Mapping[str, Any]]) -> Raw:
    """``--stage-overrides``: ``{"<stage id>": {setting: value, ...}, ...}``."""
    parsed = parse_json_bounded(value, OVERRIDES_SOURCE) if isinstance(value, str) else value
    if not isinstance(parsed, Mapping):
        msg = 'must be a JSON object mapping stage ids to settings, e.g. {"1": {"max_num_seqs": 4}}'
        raise DeployConfigError(ConfigIssue("", msg, source=OVERRIDES_SOURCE))
    stages: list[Raw] = []
    for key, settings in parsed.items():
        sid = _stage_key(key)
        where = f"stages[stage_id={sid}]"
        if sid is None:
            msg = 'keys are stage ids such as "0"'
            raise DeployConfigError(ConfigIssue(repr(key), msg, source=OVERRIDES_SOURCE))
        if not isinstance(settings, Mapping):
            msg = f"must be an object of stage settings, got {type(settings).__name__}"
            raise DeployConfigError(ConfigIssue(where, msg, sid, source=OVERRIDES_SOURCE))
        if settings.get("stage_id", sid) != sid:
            msg = f"stage_id {settings['stage_id']!r} contradicts the key {key!r}"
            raise DeployConfigError(ConfigIssue(where, msg, sid, source=OVERRIDES_SOURCE))
        stages.append({**settings, "stage_id": sid})
    return _validate_layer({"stages": stages}, OVERRIDES_SOURCE)


def _stage_key(key: object) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and re.fullmatch(r"\s*[0-9]{1,3}\s*", key):
        return int(key)
    return None


def _finish(merged: MergedLayers, pipeline: PipelineSpec, label: str) -> DeployConfig:
    data = {**merged.data, "pipeline": pipeline.name}
    data["stages"] = sorted(data.get("stages", ()), key=lambda s: int(s["stage_id"]))
    try:
        cfg = DeployConfig.model_validate(data, context={"defer_checks": True})
    except ValidationError as err:
        raise DeployConfigError(issues_from_validation(err, data, label, _KNOWN_KEYS)) from None
    problems = cfg.problems(pipeline)
    if problems:
        raise DeployConfigError([merged.attribute(p, label) for p in problems])
    _warn_suspicious(cfg)
    logger.info(
        "deploy config loaded pipeline=%s sources=%s stages=%s",
        pipeline.name,
        ",".join(merged.sources) or "defaults",
        ",".join(f"{s.stage_id}x{s.num_replicas}" for s in cfg.stages),
    )
    return cfg


def _warn_suspicious(cfg: DeployConfig) -> None:
    for s in cfg.stages:
        if s.max_inflight < s.max_num_seqs:
            logger.warning(
                "stage=%d max_inflight=%d is below max_num_seqs=%d: batches never fill",
                s.stage_id,
                s.max_inflight,
                s.max_num_seqs,
            )


def _bundled_or_none(name: str) -> Path | None:
    try:
        return bundled_deploy_path(name)
    except DeployConfigError:
        logger.info("pipeline=%s has no bundled deploy config; using defaults", name)
        return None
