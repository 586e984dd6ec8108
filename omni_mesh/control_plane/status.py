"""``omni-cp status``: a ``kubectl get``-like table of every instance the control plane knows,
with each autoscaled pool's desired replica count (a stage at zero gets a row of its own; a
split stage's prefill replicas show their own pool's), and a line per pipeline with realtime
sessions."""

from __future__ import annotations

from collections.abc import Sequence

from omni_mesh.control_plane.schema import KV_ROLE_LABEL, InstanceInfo, PipelineList
from omni_mesh.control_plane.session_schema import SessionCounts

COLUMNS = (
    "PIPELINE",
    "STAGE",
    # headless (stage only), api (stage + client API), api-only (client API, no engine); a split
    # stage's replicas add their pool: headless/prefill, headless/decode
    "ROLE",
    "INSTANCE",
    "STATE",
    "ADDRESS",
    "HOST",
    "LOAD",
    "HEARTBEAT-AGE",
    "REASON",
    # the desired replicas of the instance's pool (autoscaled stages; a split stage's prefill
    # replicas: their prefill pool's, when it autoscales), else "-"
    "DESIRED",
)


def format_age(ms: int) -> str:
    if ms < 10_000:
        return f"{ms / 1000:.1f}s"
    seconds = ms // 1000
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def _row(info: InstanceInfo, desired: int | None) -> tuple[str, ...]:
    capacity = info.load.capacity or info.capacity
    return (
        info.pipeline,
        str(info.stage_id),
        _role(info),
        info.instance_id,
        info.state.value,
        info.address,
        info.host_id or "-",
        f"{info.load.in_flight}/{capacity}",
        format_age(info.heartbeat_age_ms),
        info.reason or "-",
        "-" if desired is None else str(desired),
    )


def _role(info: InstanceInfo) -> str:
    role = info.labels.get("role", "-")
    pool = info.labels.get(KV_ROLE_LABEL)
    return f"{role}/{pool}" if pool else role


def _empty_stage_row(
    pipeline: str, stage_id: int, desired: int, role: str = "-"
) -> tuple[str, ...]:
    """An autoscaled pool with no instance at all (scaled to zero, or not started yet); a
    prefill pool's ROLE is ``-/prefill``."""
    return (pipeline, str(stage_id), role, "-", "-", "-", "-", "-", "-", "no_replicas",
            str(desired))  # fmt: skip


def _is_prefill(info: InstanceInfo) -> bool:
    return info.labels.get(KV_ROLE_LABEL) == "prefill"


def render_table(rows: Sequence[Sequence[str]], header: Sequence[str] = COLUMNS) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = [
        "   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    return "\n".join(lines)


def render_status(listing: PipelineList, *, pipeline: str | None = None) -> str:
    """The status table, sorted by pipeline, stage and registration time."""
    shown = [p for p in listing.pipelines if pipeline is None or p.pipeline == pipeline]
    desired = {(p.pipeline, s): n for p in shown for s, n in p.desired.items()}
    prefill = {(p.pipeline, s): n for p in shown for s, n in p.prefill_desired.items()}
    stages = [i for p in shown for i in p.instances]
    occupied = {(i.pipeline, i.stage_id) for i in stages if not _is_prefill(i)}
    prefilled = {(i.pipeline, i.stage_id) for i in stages if _is_prefill(i)}
    infos = [i for p in shown for i in (*p.instances, *p.api_servers)]
    empty = sorted(k for k in desired if k not in occupied)
    empty_prefill = sorted(k for k in prefill if k not in prefilled)
    if not infos and not empty and not empty_prefill:
        return "no instances registered" + (f" for pipeline {pipeline!r}" if pipeline else "")
    keyed = [
        (
            (i.pipeline, i.stage_id, i.registered_at_ms, i.instance_id),
            _row(i, (prefill if _is_prefill(i) else desired).get((i.pipeline, i.stage_id))),
        )
        for i in infos
    ]
    keyed += [((p, s, -1, ""), _empty_stage_row(p, s, desired[(p, s)])) for p, s in empty]
    keyed += [
        ((p, s, -1, "prefill"), _empty_stage_row(p, s, prefill[(p, s)], "-/prefill"))
        for p, s in empty_prefill
    ]
    keyed.sort(key=lambda kr: kr[0])
    return render_table([row for _, row in keyed])


def render_sessions(counts: Sequence[SessionCounts], *, pipeline: str | None = None) -> str:
    """``sessions pipeline=P owned=N released=M``, one line per pipeline with sessions."""
    return "\n".join(
        f"sessions pipeline={c.pipeline} owned={c.owned} released={c.released}"
        for c in sorted(counts, key=lambda c: c.pipeline)
        if (pipeline is None or c.pipeline == pipeline) and (c.owned or c.released)
    )
