"""Command-line flags derived from a pydantic-settings model: one flag per field, one variable
per flag, and one precedence.

Every flag defaults to :data:`argparse.SUPPRESS`, so a flag that was not given is absent from
the parsed namespace and pydantic-settings fills the field from its environment variable
(``<env_prefix><FIELD>``), else from the field's default: defaults < environment < flags. A
flag's help, type and bounds come from the field; the value is validated by the model, and an
error names both the flag and the variable (:func:`settings_error_text`). The same
:class:`SettingFlag` tables generate the settings tables of docs/configuration.md.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import AliasChoices, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

__all__ = [
    "SettingFlag",
    "add_pipeline_module_flag",
    "add_setting_flags",
    "env_kwargs",
    "env_names",
    "flag_specs",
    "settings_error_text",
    "settings_kwargs",
]


@dataclass(frozen=True)
class SettingFlag:
    """The flag(s) of one settings field; the first is its canonical name."""

    field: str
    flags: tuple[str, ...]
    kind: typing.Literal["value", "bool", "append"] = "value"


def _kind(field: FieldInfo) -> typing.Literal["value", "bool", "append"]:
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = members[0] if len(members) == 1 else annotation
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if annotation is bool:
        return "bool"
    if typing.get_origin(annotation) in (tuple, list):
        return "append"
    return "value"


def flag_specs(
    model: type[BaseSettings],
    *,
    aliases: Mapping[str, Iterable[str]] | None = None,
    names: Mapping[str, str] | None = None,
    skip: Iterable[str] = (),
) -> tuple[SettingFlag, ...]:
    """One :class:`SettingFlag` per field of ``model`` (``max_body_bytes`` ->
    ``--max-body-bytes``), with extra ``aliases`` and other canonical ``names`` per field."""
    aliases, names, skipped = aliases or {}, names or {}, set(skip)
    out = []
    for name, field in model.model_fields.items():
        if name in skipped:
            continue
        canonical = names.get(name, "--" + name.replace("_", "-"))
        out.append(SettingFlag(name, (canonical, *aliases.get(name, ())), _kind(field)))
    return tuple(out)


def add_setting_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseSettings],
    specs: Iterable[SettingFlag],
) -> None:
    """Add each spec's flag(s) to ``parser``; every one defaults to SUPPRESS."""
    for spec in specs:
        field = model.model_fields[spec.field]
        help_text = _help(field, env_names(model, spec.field))
        common: dict[str, Any] = {"dest": spec.field, "default": argparse.SUPPRESS}
        if spec.kind == "bool":
            parser.add_argument(
                *spec.flags, action=argparse.BooleanOptionalAction, help=help_text, **common
            )
        elif spec.kind == "append":
            metavar = "URL" if spec.field.endswith(("plane", "url", "urls")) else "VALUE"
            parser.add_argument(
                *spec.flags, action="append", metavar=metavar, help=help_text, **common
            )
        else:
            metavar = spec.field.rsplit("_", 1)[-1].upper()
            parser.add_argument(*spec.flags, metavar=metavar, help=help_text, **common)


def add_pipeline_module_flag(parser: argparse.ArgumentParser) -> None:
    """``--pipeline-module MODULE`` (repeatable), shared by omni-stage, omni-up and omni-run."""
    parser.add_argument(
        "--pipeline-module",
        action="append",
        metavar="MODULE",
        help="import MODULE to register your own pipelines (repeatable; env "
        "OMNI_PIPELINE_MODULES, comma-separated; installed packages: entry-point group "
        "omni_mesh.pipelines)",
    )


def settings_kwargs(ns: argparse.Namespace, specs: Iterable[SettingFlag]) -> dict[str, Any]:
    """The settings flags that were given, as keyword arguments of the model."""
    given = vars(ns)
    out = {s.field: given[s.field] for s in specs if s.field in given}
    for spec in specs:  # an appended flag may hold comma-separated items
        if spec.kind == "append" and spec.field in out:
            out[spec.field] = tuple(
                part.strip() for item in out[spec.field] for part in item.split(",") if part.strip()
            )
    return out


def env_kwargs(
    model: type[BaseSettings], specs: Iterable[SettingFlag], env: Mapping[str, str]
) -> dict[str, Any]:
    """The settings of ``specs`` found in ``env`` (for a caller that passes its own
    environment), as keyword arguments: flags given on top of these win."""
    out: dict[str, Any] = {}
    for spec in specs:
        for name in env_names(model, spec.field):
            if name in env:
                value: Any = env[name]
                if spec.kind == "append":
                    value = tuple(p.strip() for p in value.split(",") if p.strip())
                out[spec.field] = value
                break
    return out


def env_names(model: type[BaseSettings], field: str) -> tuple[str, ...]:
    """The environment variables of a field: ``OMNI_STAGE_PORT``, or its alias choices."""
    alias = model.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        return tuple(str(c).upper() for c in alias.choices if str(c) != field)
    prefix = str(model.model_config.get("env_prefix", ""))
    return (f"{prefix}{field}".upper(),)


def settings_error_text(
    exc: ValidationError, model: type[BaseSettings], specs: Iterable[SettingFlag]
) -> str:
    """One line naming, for each problem, the flag and variable of the field at fault."""
    flags = {s.field: s.flags[0] for s in specs}
    problems = []
    for err in exc.errors(include_url=False, include_input=False):
        field = str(err["loc"][0]) if err["loc"] else ""
        msg = str(err["msg"]).removeprefix("Value error, ")
        if field in model.model_fields:
            flag = flags.get(field, "--" + field.replace("_", "-"))
            where = " / ".join((flag, *env_names(model, field)))
            problems.append(f"{where}: {msg}")
        else:
            problems.append(msg)
    return "; ".join(problems)


def _help(field: FieldInfo, env: tuple[str, ...]) -> str:
    default = field.default
    if field.default_factory is not None:
        shown = "computed"
    elif field.is_required():
        shown = "none: required"
    elif default is None or default == ():
        shown = "unset"
    else:
        shown = str(default.value if hasattr(default, "value") else default)
    text = f"{(field.description or '').rstrip('.')} (default {shown}; env {' or '.join(env)})"
    return text.replace("%", "%%")
