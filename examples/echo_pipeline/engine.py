"""The engines of the ``echo`` example: plain Python classes implementing the engine protocol
(:class:`omni_mesh.api.StageEngine`: ``load`` once, then ``execute`` per batch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from omni_mesh.api import (
    EngineInputError,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)

MAX_TIMES = 16


class ShoutEngine(StageEngine):
    """Stage 0: ``prompt`` -> ``shouted`` (upper-cased); passes ``max_tokens`` on."""

    uses_torch: ClassVar[bool] = False  # no torch in this engine's process

    def load(self) -> None:
        self.suffix = str(self.ctx.config.engine_extras.get("suffix", "!"))

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        results = []
        for request in batch:
            text = str(request.data.fields.get("prompt", ""))
            fields = {
                "shouted": text.upper() + self.suffix,
                "max_tokens": request.data.fields.get("max_tokens", 2),
            }
            results.append(EngineResult(request.request_id, output=StageData(fields=fields)))
        return results


class EchoEngine(StageEngine):
    """Stage 1 (final, text): the shouted text repeated ``max_tokens`` times (a prompt field)."""

    uses_torch: ClassVar[bool] = False

    def load(self) -> None:
        pass

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        results = []
        for request in batch:
            times = request.data.fields.get("max_tokens", 2)
            if not isinstance(times, int) or isinstance(times, bool) or not 1 <= times <= MAX_TIMES:
                error = EngineInputError(
                    f"echo: 'max_tokens' must be an integer from 1 to {MAX_TIMES}"
                )
                results.append(EngineResult(request.request_id, error=str(error)))
                continue
            text = " ".join([str(request.data.fields.get("shouted", ""))] * times)
            results.append(EngineResult(request.request_id, final=StageData({"text": text})))
        return results
