"""One input the engine core admitted, and its stream of results (``core.py``); and the usage
rule: each step's whole time shared among the requests it advanced."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from omni_mesh.data_plane.messages import StageInput, StageOutput, streams_out
from omni_mesh.engines.base import EngineResult
from omni_mesh.engines.fed import FedRequest

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class AdmittedStream:
    """One admitted input and the engine's stream of results for it."""

    si: StageInput
    results: Iterator[EngineResult | None]  # None: nothing this step (the engine batches itself)
    queue_ms: float  # the input's wait before admission, reported on its first output
    emitted: int = 0  # results turned into outputs so far
    forwarded: int = 0  # of which built next-stage inputs (``EngineResult.forward``)
    fed: FedRequest | None = None  # a streamed input's request, its later chunks merged
    used_ms: float = 0.0  # its share of the steps since its last output (StageOutput.used_ms)
    whole: bool = field(init=False)  # its answer may stream (a whole input, or a streamed one)

    def __post_init__(self) -> None:
        self.whole = streams_out(self.si)  # (read several times per output: kept)

    @property
    def next_chunk(self) -> int:
        """The chunk index the stream's next output gets (the chunk numbering rule)."""
        return self.emitted if self.whole else self.si.chunk

    def close(self) -> None:
        close = getattr(self.results, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # a stream that fails to close must not take the engine down
            logger.exception("closing a stream failed request_id=%s", self.si.request_id)


def share_step(
    streams: list[AdmittedStream], produced: dict[int, StageOutput], started: float
) -> None:
    """Usage: the step's whole time (its outputs built and written too) shared among the
    requests it advanced; each output carries its request's shares since its previous one
    (``StageOutput.used_ms``)."""
    if not streams:
        return
    share = (time.monotonic() - started) * 1000.0 / len(streams)
    for stream in streams:
        stream.used_ms += share
        out = produced.get(id(stream))
        if out is not None:
            out.used_ms, stream.used_ms = stream.used_ms, 0.0
