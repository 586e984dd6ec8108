"""Command-line flags and environment variables for deploy settings, derived from the models.

Each stage flag's type, bounds, choices and help come from :class:`StageDeployConfig` (and the
pipeline-wide ``--async-chunk`` from :class:`DeployConfig`), so a flag and the YAML key it
overrides can never disagree. Every flag defaults to ``None``: a flag is *explicit* exactly when
it was given, and only explicit flags override the deploy config. The same settings are read
from ``OMNI_STAGE_<FIELD>`` variables (:func:`env_overrides`), one level below the flags.

Precedence, lowest first: defaults < bundled YAML < overlay < platform section < environment <
flags < ``--stage-overrides``.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from omni_mesh.configs.deploy import DeployConfig, StageDeployConfig

__all__ = [
    "DEPLOY_FLAG_FIELDS",
    "PIPELINE_FLAG_FIELDS",
    "STAGE_FLAG_FIELDS",
    "add_stage_flags",
    "cli_overrides_from_args",
    "deploy_field",
    "env_name",
    "env_overrides",
    "field_bounds",
    "flag_name",
]

STAGE_FLAG_FIELDS: tuple[str, ...] = (
    "num_replicas",
    "max_num_seqs",
    "max_inflight",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "enforce_eager",
    "dtype",
    "devices",
    "step_latency_ms",
    "per_item_latency_ms",
    "output_bytes",
    "output_chunks",
)
#: Pipeline-wide deploy settings that have a flag (they must agree across a pipeline's pods).
PIPELINE_FLAG_FIELDS: tuple[str, ...] = ("async_chunk",)
DEPLOY_FLAG_FIELDS: tuple[str, ...] = STAGE_FLAG_FIELDS + PIPELINE_FLAG_FIELDS
#: Environment prefix of the deploy settings of ``omni-stage`` (and of the stages omni-up starts).
STAGE_ENV_PREFIX = "OMNI_STAGE_"


_METAVARS: dict[Any, str] = {int: "N", float: "X", "devices": "IDS"}


def flag_name(field: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field.replace("_", "-")


def env_name(field: str, prefix: str = STAGE_ENV_PREFIX) -> str:
    """``max_num_seqs`` -> ``OMNI_STAGE_MAX_NUM_SEQS``."""
    return prefix + field.upper()


def deploy_field(name: str) -> FieldInfo:
    """The model field behind a deploy flag (a stage field, or a pipeline-wide one)."""
    if name in PIPELINE_FLAG_FIELDS:
        return DeployConfig.model_fields[name]
    return StageDeployConfig.model_fields[name]


def add_stage_flags(
    parser: argparse.ArgumentParser, fields: tuple[str, ...] = DEPLOY_FLAG_FIELDS
) -> None:
    """Add one flag per field in ``fields`` (all default to None)."""
    group = parser.add_argument_group(
        "deploy settings",
        "Override the deploy config for the stage(s) this process runs (environment: "
        f"{STAGE_ENV_PREFIX}<FIELD>); --stage-overrides JSON takes precedence over these flags.",
    )
    for name in fields:
        field = deploy_field(name)
        base = _base_type(field.annotation)
        help_text = _help(field)
        if base is bool:
            group.add_argument(
                flag_name(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
            continue
        choices = typing.get_args(base) if typing.get_origin(base) is Literal else None
        group.add_argument(
            flag_name(name),
            dest=name,
            type=_field_parser(name, field),
            default=None,
            choices=choices,
            metavar=None if choices else _METAVARS.get(name, _METAVARS.get(base, "VALUE")),
            help=help_text,
        )


def cli_overrides_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The deploy flags that were given explicitly, as ``{field: value}``."""
    return {
        name: value for name in DEPLOY_FLAG_FIELDS if (value := getattr(ns, name, None)) is not None
    }


def env_overrides(env: Mapping[str, str], prefix: str = STAGE_ENV_PREFIX) -> dict[str, Any]:
    """The deploy settings set in the environment (``OMNI_STAGE_MAX_INFLIGHT=64``), validated
    as their flags are; a bad value raises ValueError naming the variable."""
    out: dict[str, Any] = {}
    for name in DEPLOY_FLAG_FIELDS:
        text = env.get(env_name(name, prefix))
        if text is None:
            continue
        try:
            out[name] = _field_parser(name, deploy_field(name))(text)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{env_name(name, prefix)}: {exc}") from None
    return out


def _field_parser(name: str, field: FieldInfo) -> Callable[[str], Any]:
    """A converter that validates a flag value exactly as the model field would."""
    annotation: Any = field.annotation
    if field.metadata:
        annotation = Annotated.__class_getitem__((annotation, *field.metadata))  # type: ignore[attr-defined]
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)

    def parse(text: str) -> Any:
        try:
            value = adapter.validate_python(text)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            msg = str(first["msg"]).removeprefix("Value error, ")
            raise argparse.ArgumentTypeError(f"{msg} (got {text!r})") from None
        if value is None:
            raise argparse.ArgumentTypeError(f"a value is required (got {text!r})")
        return value

    parse.__name__ = name  # argparse names the converter in some messages
    return parse


def _base_type(annotation: Any) -> Any:
    """``X | None`` -> ``X``; Annotated wrappers are unwrapped."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = members[0] if len(members) == 1 else annotation
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def field_bounds(field: FieldInfo) -> str:
    """The numeric bounds of a field as text, e.g. ``1 <= x <= 4096``; '' when unbounded."""
    low = high = ""
    for meta in field.metadata:
        for attr, text in (("ge", "<="), ("gt", "<")):
            if getattr(meta, attr, None) is not None:
                low = f"{getattr(meta, attr)} {text} "
        for attr, text in (("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                high = f" {text} {getattr(meta, attr)}"
    return f"{low}x{high}" if low or high else ""


def _help(field: FieldInfo) -> str:
    bounds = field_bounds(field)
    default = "unset" if field.default is None else str(field.default)
    details = f"{bounds}; default {default}" if bounds else f"default {default}"
    return f"{(field.description or '').rstrip('.')} ({details})"
