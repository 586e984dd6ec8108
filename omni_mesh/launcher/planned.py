"""One process omni-up plans to start (:class:`Planned`): made by ``local_deploy``, started by
the supervisor, adopted into a pool by the autoscaling actuator."""

from __future__ import annotations

from dataclasses import dataclass

#: Where omni-up's children listen unless told otherwise.
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class Planned:
    """One process to start: its name, command line and where it answers."""

    name: str
    argv: tuple[str, ...]
    url: str
    label: str  # shown in the endpoint list
    health_path: str = "/health"
    stop_rank: int = 0  # stopped in ascending rank: API server, stage 0, 1, …, control plane
    stage_id: int | None = None  # a stage replica's stage
    role: str = ""  # a split stage's replica: "prefill" or "decode"
    slot: int = 0  # a stage replica's slot: its slice of the stage's devices (--replica-index)

    @property
    def ready_url(self) -> str:
        return f"{_probe_url(self.url)}{self.health_path}"


def _probe_url(url: str) -> str:
    """Where to check a server that listens on every interface."""
    for wildcard in ("http://0.0.0.0:", "http://[::]:"):
        if url.startswith(wildcard):
            return f"http://{LOCALHOST}:{url.removeprefix(wildcard)}"
    return url
