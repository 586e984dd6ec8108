"""The field tables of docs/configuration.md are generated from the pydantic models.

The test fails when the doc drifts from the schema. Regenerate the tables with
    .venv/bin/python tests/configs/test_configuration_doc.py --write
Only the text between ``<!-- generated:NAME:begin -->`` and ``<!-- generated:NAME:end -->``
markers is rewritten; the prose around the tables is left alone.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.cli_flags import DEPLOY_FLAG_FIELDS, env_name, field_bounds, flag_name
from omni_mesh.configs.deploy import ConnectorSpec, DeployConfig, PlatformSection, StageDeployConfig
from omni_mesh.configs.deploy_fields import StageSampling
from omni_mesh.configs.settings import ControlPlaneSettings, UpSettings
from omni_mesh.configs.settings_flags import SettingFlag, env_names
from omni_mesh.configs.stage_deploy import PrefillPool
from omni_mesh.configs.stage_settings import STAGE_FLAGS, StageSettings
from omni_mesh.control_plane.cli import SERVE_FLAGS
from omni_mesh.launcher.cli import UP_FLAGS

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
MODELS: dict[str, type[BaseModel]] = {
    "top-level": DeployConfig,
    "connector": ConnectorSpec,
    "stage": StageDeployConfig,
    "sampling": StageSampling,
    "autoscale": AutoscaleConfig,
    "prefill": PrefillPool,
    "platform": PlatformSection,
}
_BLOCK = re.compile(r"(<!-- generated:([\w-]+):begin -->\n).*?(<!-- generated:\2:end -->)", re.S)


def type_text(annotation: Any) -> str:
    """A reader's name for a field type: ``int or null``, ``one of "uni", "mp"``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [type_text(a) for a in args if a is not type(None)]
        text = " or ".join(members)
        return f"{text} or null" if type(None) in args else text
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f'"{v}"' for v in args)
    if origin is dict:
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}"
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return f"list of {type_text(args[0])}"
    if annotation is Any:
        return "any"
    names = {bool: "bool", int: "int", float: "float", str: "string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):  # a nested section: its own table says its defaults
            return "`{}`"
        return f"`{value!r}`"
    if isinstance(field.default, BaseModel):
        return "`{}`"
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "null"
    if isinstance(field.default, bool):
        return f"`{str(field.default).lower()}`"
    return f"`{field.default}`"


def bounds_text(field: FieldInfo) -> str:
    parts = [field_bounds(field)] if field_bounds(field) else []
    for meta in field.metadata:
        if getattr(meta, "max_length", None) is not None:
            parts.append(f"at most {meta.max_length} entries")
    return "; ".join(p.replace("<=", "≤") for p in parts)


def model_table(model: type[BaseModel]) -> str:
    rows = ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        rows.append(
            f"| `{name}` | {type_text(field.annotation)} | {default_text(field)} "
            f"| {bounds_text(field)} | {field.description} |"
        )
    return "\n".join(rows) + "\n"


def flags_table() -> str:
    rows = ["| flag | variable | deploy key |", "|---|---|---|"]
    rows += [
        f"| `{flag_name(name)}` | `{env_name(name)}` | `{name}` |" for name in DEPLOY_FLAG_FIELDS
    ]
    return "\n".join(rows) + "\n"


#: The settings of each process: one flag and one variable per setting, from the same specs
#: that build the parsers.
SETTINGS: dict[str, tuple[type[BaseSettings], tuple[SettingFlag, ...]]] = {
    "stage-settings": (StageSettings, STAGE_FLAGS),
    "cp-settings": (ControlPlaneSettings, SERVE_FLAGS),
    "up-settings": (UpSettings, UP_FLAGS),
}


def settings_table(model: type[BaseSettings], specs: tuple[SettingFlag, ...]) -> str:
    rows = ["| setting | flag | variable | default | description |", "|---|---|---|---|---|"]
    for spec in specs:
        field = model.model_fields[spec.field]
        flags = ", ".join(f"`{f}`" for f in spec.flags)
        if spec.kind == "bool":
            flags += f" / `--no-{spec.flags[0].removeprefix('--')}`"
        env = ", ".join(f"`{e}`" for e in env_names(model, spec.field))
        default = "host name" if spec.field == "host_id" else default_text(field)
        rows.append(f"| `{spec.field}` | {flags} | {env} | {default} | {field.description} |")
    return "\n".join(rows) + "\n"


def blocks() -> dict[str, str]:
    out = {name: model_table(model) for name, model in MODELS.items()}
    out["cli-flags"] = flags_table()
    out.update({name: settings_table(*spec) for name, spec in SETTINGS.items()})
    return out


def render(text: str) -> str:
    """``text`` with every generated block replaced by its current content."""
    tables = blocks()

    def fill(match: re.Match[str]) -> str:
        return match.group(1) + tables[match.group(2)] + match.group(3)

    return _BLOCK.sub(fill, text)


def test_doc_has_every_generated_block() -> None:
    found = {m.group(2) for m in _BLOCK.finditer(DOC.read_text())}
    assert found == set(blocks())


def test_doc_is_up_to_date() -> None:
    text = DOC.read_text()
    assert render(text) == text, (
        "docs/configuration.md is out of date with the deploy schema; run "
        ".venv/bin/python tests/configs/test_configuration_doc.py --write"
    )


def test_every_field_is_documented() -> None:
    for model in MODELS.values():
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert "\n" not in field.description, f"{model.__name__}.{name}: one line"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        DOC.write_text(render(DOC.read_text()))
    else:
        sys.exit(0 if render(DOC.read_text()) == DOC.read_text() else 1)
