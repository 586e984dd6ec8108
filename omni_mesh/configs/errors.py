"""Deploy config errors: :class:`ConfigIssue`, :class:`DeployConfigError`, and the conversion of a
pydantic :class:`~pydantic.ValidationError` into issues that name the source, the field path and
the stage."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

__all__ = ["MAX_ISSUES", "ConfigIssue", "DeployConfigError", "issues_from_validation"]

MAX_ISSUES = 20
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One problem in a deploy config: where it came from, which field, which stage."""

    path: str
    message: str
    stage_id: int | None = None
    key: str | None = None  # the stage field (or top-level key) at fault, for provenance
    source: str | None = None  # file name, "command line" or "--stage-overrides"

    def __str__(self) -> str:
        return ": ".join(p for p in (self.source, self.path, self.message) if p)


class DeployConfigError(ValueError):
    """A deploy config (file, platform section or override) is invalid; one line per issue."""

    def __init__(self, issues: Sequence[ConfigIssue] | ConfigIssue) -> None:
        self.issues: tuple[ConfigIssue, ...] = (
            (issues,) if isinstance(issues, ConfigIssue) else tuple(issues)
        )
        super().__init__("\n".join(str(i) for i in self.issues))


def issues_from_validation(
    err: ValidationError,
    raw: Mapping[str, Any],
    source: str,
    known_keys: Sequence[str] = (),
) -> list[ConfigIssue]:
    """Turn a pydantic error into issues that name ``source``, the field path and the stage.

    ``known_keys`` are the valid key names an unknown key is matched against ("did you mean").
    """
    issues: dict[str, ConfigIssue] = {}
    for e in err.errors(include_url=False):
        path, stage_id = _loc_path(e["loc"], raw, e["type"])
        msg = _message(e, known_keys)
        if path in issues:  # one line per field: the members of a union fail together
            old = issues[path]
            if msg not in old.message:
                issues[path] = replace(old, message=f"{old.message}, or {msg}")
            continue
        key = next((str(x) for x in reversed(e["loc"]) if isinstance(x, str)), None)
        issues[path] = ConfigIssue(path, msg, stage_id, key, source)
    return list(issues.values())[:MAX_ISSUES]


def _loc_path(loc: tuple[int | str, ...], raw: Any, etype: str) -> tuple[str, int | None]:
    """``('stages', 1, 'max_num_seqs')`` -> ``stages[stage_id=1].max_num_seqs``, by walking the
    raw input alongside the location (union-member tags in ``loc`` are skipped)."""
    path = ""
    node: Any = raw
    parent: object = None
    stage_id: int | None = None
    for i, item in enumerate(loc):
        if isinstance(item, int) and isinstance(node, list) and 0 <= item < len(node):
            sid = _stage_id_of(node[item]) if parent == "stages" else None
            path += f"[stage_id={sid}]" if sid is not None else f"[{item}]"
            stage_id = sid if sid is not None else stage_id
            node, parent = node[item], None
        elif isinstance(node, Mapping) and (
            item in node or (etype == "missing" and i == len(loc) - 1)
        ):
            path += f".{item}" if path else str(item)
            node, parent = node.get(item), item
    return path, stage_id


def _stage_id_of(entry: object) -> int | None:
    sid = entry.get("stage_id") if isinstance(entry, Mapping) else None
    if isinstance(sid, int) and not isinstance(sid, bool):
        return sid
    if isinstance(sid, str) and re.fullmatch(r"\s*[0-9]{1,3}\s*", sid):
        return int(sid)
    return None


def _message(e: Any, known_keys: Sequence[str]) -> str:
    msg = str(e["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if e["type"] == "extra_forbidden":
        name = str(e["loc"][-1]) if e["loc"] else ""
        close = difflib.get_close_matches(name, known_keys, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        if "stages" in e["loc"]:
            hint += "; free-form engine keys go under engine_extras:"
        return "unknown key" + hint
    value = e.get("input")
    if e["type"] not in ("value_error", "missing") and isinstance(value, _SCALARS):
        shown = repr(value)
        msg += f" (got {shown[:60] + '...' if len(shown) > 60 else shown})"
    return msg
