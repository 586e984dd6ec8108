"""The sender's side of a split stage's KV hand-off (``data_plane/kv_transfer.py``): which
decode attempt the prefill's params are for."""

from __future__ import annotations

from omni_mesh.sidecar.hop.budget import HopStats


class KvHandoff:
    """A split stage's hop: the params of its prefill and the attempt they were made for.
    A retry of the decode on another replica (the first failed before it answered) goes
    without them: that replica may already have pulled the KV, which the prefill engine then
    freed, and a second read of those blocks would read whatever reuses them. It prefills for
    itself instead (counted ``local``)."""

    __slots__ = ("attempt", "dropped", "params")

    def __init__(self) -> None:
        self.params = ""
        self.attempt = -1
        self.dropped = False

    def prefilled(self, params: str, attempt: int) -> None:
        self.params, self.attempt, self.dropped = params, attempt, False

    def params_for(self, attempt: int, stats: HopStats) -> str:
        if not self.params or attempt == self.attempt:
            return self.params
        if not self.dropped:
            self.dropped = True
            stats.kv_handoffs.append("local")
        return ""
