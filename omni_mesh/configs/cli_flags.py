"""Command-line flags for stage deploy settings, derived from :class:`StageDeployConfig`.

Each flag's type, bounds, choices and help come from the model field, so a flag and the YAML key
it overrides can never disagree. Every flag defaults to ``None``: a flag is *explicit* exactly
when it was given, and only explicit flags override the deploy config (precedence: above the
YAML layers, below ``--stage-overrides``).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from omni_mesh.configs.deploy import StageDeployConfig

__all__ = [
    "STAGE_FLAG_FIELDS",
    "add_stage_flags",
    "cli_overrides_from_args",
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


_METAVARS: dict[Any, str] = {int: "N", float: "X", "devices": "IDS"}


def flag_name(field: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field.replace("_", "-")


def add_stage_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per field in :data:`STAGE_FLAG_FIELDS` (all default to None)."""
    group = parser.add_argument_group(
        "stage deploy settings",
        "Override the deploy config for the stage(s) this process runs; "
        "--stage-overrides JSON takes precedence over these flags.",
    )
    for name in STAGE_FLAG_FIELDS:
        field = StageDeployConfig.model_fields[name]
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
    """The stage flags that were given explicitly, as ``{field: value}``."""
    return {
        name: value for name in STAGE_FLAG_FIELDS if (value := getattr(ns, name, None)) is not None
    }


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
