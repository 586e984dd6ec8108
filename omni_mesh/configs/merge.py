"""Merging deploy config layers: a deep merge where ``stages`` merge by ``stage_id``, plus the
provenance of every merged (stage, key) so an issue in the result names the layer that set it."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from omni_mesh.configs.errors import ConfigIssue

__all__ = ["MergedLayers", "Raw", "merge"]

Raw = dict[str, Any]
_ProvKey = tuple[int | None, str]

# Settings whose product (with num_replicas) is the device count a stage's `devices` must match.
_WORLD_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "data_parallel_size_local",
    "num_replicas",
)


@dataclass
class MergedLayers:
    """The merged raw config so far and which source last set each (stage, key)."""

    data: Raw = field(default_factory=dict)
    provenance: dict[_ProvKey, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def apply(self, layer: Mapping[str, Any], source: str) -> None:
        self.data = merge(self.data, layer)
        self.sources.append(source)
        for key in layer:
            if key not in ("stages", "platforms"):
                self.provenance[(None, key)] = source
        for stage in layer.get("stages", ()):
            sid = stage["stage_id"]
            self.provenance.setdefault((sid, "stage_id"), source)
            for key in stage:
                if key != "stage_id":
                    self.provenance[(sid, key)] = source

    def add_missing_stages(self, stage_ids: Collection[int]) -> None:
        present = {s["stage_id"] for s in self.data.get("stages", ())}
        missing = [{"stage_id": sid} for sid in stage_ids if sid not in present]
        self.data = {**self.data, "stages": [*self.data.get("stages", ()), *missing]}

    def source_of(self, issue: ConfigIssue, default: str) -> str:
        if issue.key is None or issue.path.startswith("platforms."):
            return default
        return (
            self.provenance.get((issue.stage_id, issue.key))
            or self.provenance.get((None, issue.key))
            or default
        )

    def attribute(self, issue: ConfigIssue, default: str) -> ConfigIssue:
        """``issue`` with the source that set its key; a device-count issue also names the
        sources of the sizes it was checked against when they differ."""
        source = self.source_of(issue, default)
        if issue.key != "devices":
            return replace(issue, source=source)
        others = {
            key: src
            for key in _WORLD_KEYS
            if (src := self.provenance.get((issue.stage_id, key))) and src != source
        }
        note = "; ".join(f"{k} set by {v}" for k, v in others.items())
        message = f"{issue.message} ({note})" if note else issue.message
        return replace(issue, source=source, message=message)


def merge(base: Mapping[str, Any], over: Mapping[str, Any], *, top: bool = True) -> Raw:
    """Deep merge: mappings recurse, lists and scalars replace; ``stages`` merge by stage_id
    (at the top level and inside platform sections)."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if top and key == "stages" and isinstance(old, list) and isinstance(value, list):
            out[key] = _merge_stages(old, value)
        elif top and key == "platforms" and isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = {**old, **{n: merge(old.get(n) or {}, v) for n, v in value.items()}}
        elif isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = merge(old, value, top=False)
        else:
            out[key] = value
    return out


def _merge_stages(old: list[Raw], new: list[Raw]) -> list[Raw]:
    by_id = {s["stage_id"]: s for s in old}
    for s in new:
        sid = s["stage_id"]
        by_id[sid] = merge(by_id[sid], s, top=False) if sid in by_id else dict(s)
    return list(by_id.values())
