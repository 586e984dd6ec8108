"""Bounded, safe parsing of deploy config text: YAML files (size and node limits, safe loader,
no duplicate keys, no alias bombs) and JSON flag values (size limit, no duplicate keys). Every
failure is a :class:`DeployConfigError` that names the file or flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from omni_mesh.configs.errors import ConfigIssue, DeployConfigError

__all__ = [
    "MAX_OVERRIDES_BYTES",
    "MAX_YAML_BYTES",
    "MAX_YAML_NODES",
    "parse_json_bounded",
    "read_yaml",
]

MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 100_000
MAX_OVERRIDES_BYTES = 64 << 10


def read_yaml(path: Path, label: str) -> dict[str, Any]:
    """Parse one deploy YAML (bounded size, safe loader, no duplicate keys) into a mapping."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except OSError as err:
        msg = f"cannot read deploy config: {err.strerror or err}"
        raise DeployConfigError(ConfigIssue("", msg, source=label)) from None
    if len(raw) > MAX_YAML_BYTES:
        msg = f"file is larger than the {MAX_YAML_BYTES >> 20} MiB limit for deploy configs"
        raise DeployConfigError(ConfigIssue("", msg, source=label))
    try:
        text = raw.decode("utf-8")
        _check_nodes(yaml.compose(text, Loader=yaml.SafeLoader), label)
        data = yaml.safe_load(text)
    except UnicodeDecodeError as err:
        msg = f"not UTF-8 text (bad byte at offset {err.start})"
        raise DeployConfigError(ConfigIssue("", msg, source=label)) from None
    except yaml.YAMLError as err:
        raise DeployConfigError(ConfigIssue("", _yaml_message(err), source=label)) from None
    except RecursionError:
        msg = "YAML nesting is too deep"
        raise DeployConfigError(ConfigIssue("", msg, source=label)) from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        got = type(data).__name__ if not isinstance(data, dict) else "non-string keys"
        msg = f"top level must be a mapping of settings, got {got}"
        raise DeployConfigError(ConfigIssue("", msg, source=label))
    return data


def _check_nodes(root: yaml.Node | None, label: str) -> None:
    """Refuse duplicate mapping keys and alias bombs (node count after alias expansion)."""
    stack = [root] if root is not None else []
    count = 0
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_YAML_NODES:
            msg = f"more than {MAX_YAML_NODES} YAML nodes (after expanding aliases)"
            raise DeployConfigError(ConfigIssue("", msg, source=label))
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in seen:
                        line = key.start_mark.line + 1
                        msg = f"line {line}: duplicate key {key.value!r}"
                        raise DeployConfigError(ConfigIssue("", msg, source=label))
                    seen.add(key.value)
                stack += (key, value)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def _yaml_message(err: yaml.YAMLError) -> str:
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        what = ": ".join(p for p in (err.context, err.problem) if p)
        return f"line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {what}"
    return f"invalid YAML: {err}"


def parse_json_bounded(text: str, source: str) -> Any:
    """Parse a JSON flag value: bounded size, no duplicate keys, errors that name the flag."""
    if len(text.encode()) > MAX_OVERRIDES_BYTES:
        msg = f"larger than the {MAX_OVERRIDES_BYTES >> 10} KiB limit"
        raise DeployConfigError(ConfigIssue("", msg, source=source))
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        msg = f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}"
        raise DeployConfigError(ConfigIssue("", msg, source=source)) from None
    except (ValueError, RecursionError) as err:
        msg = f"invalid JSON: {err}" if isinstance(err, ValueError) else "JSON nesting is too deep"
        raise DeployConfigError(ConfigIssue("", msg, source=source)) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out
