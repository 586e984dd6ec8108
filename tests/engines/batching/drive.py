"""Driving a batched talker engine as the engine core does, and watching its forwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from omni_mesh.engines.base import EngineRequest, EngineResult, StageData, StageEngine


class Forwards:
    """(rows, positions) of every forward of ``module`` (read off its ``inputs_embeds``)."""

    def __init__(self, module: Any) -> None:
        self.shapes: list[tuple[int, int]] = []
        self._hook = module.register_forward_hook(self._on, with_kwargs=True)

    def _on(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        rows, length = kwargs["inputs_embeds"].shape[:2]
        self.shapes.append((int(rows), int(length)))

    @property
    def decodes(self) -> list[int]:
        """The rows of each one-position forward (a decode step), in order."""
        return [rows for rows, length in self.shapes if length == 1]

    @property
    def prefills(self) -> list[int]:
        """The positions of each longer forward (a prompt, always alone)."""
        return [length for rows, length in self.shapes if length > 1 and rows == 1]

    def close(self) -> None:
        self._hook.remove()


def drive(
    engine: StageEngine,
    arrivals: dict[int, list[EngineRequest]],
    aborts: dict[int, list[str]] | None = None,
) -> tuple[dict[str, list[EngineResult]], dict[str, BaseException]]:
    """Steps as the core runs them: open the requests arriving at step k, ``before_step``, one
    ``next()`` on every stream, close the ones aborted at step k. Every result of every
    request, and the exception of each stream that raised."""
    aborts = aborts or {}
    streams: dict[str, Iterator[EngineResult | None]] = {}
    results: dict[str, list[EngineResult]] = {}
    errors: dict[str, BaseException] = {}
    step = 0
    while streams or any(k >= step for k in arrivals):
        new = arrivals.get(step, [])
        streams.update(zip([r.request_id for r in new], engine.open(new), strict=True))
        engine.before_step(len(streams))
        for rid, stream in list(streams.items()):
            try:
                result = next(stream)
            except Exception as exc:
                errors[rid] = exc
                del streams[rid]
                continue
            if result is not None:
                results.setdefault(rid, []).append(result)
                if result.last:
                    del streams[rid]
        for rid in aborts.get(step, []):
            streams.pop(rid).close()  # type: ignore[attr-defined]
        step += 1
    return results, errors


def codes(results: list[EngineResult]) -> np.ndarray:
    """A request's codes: its chunks' concatenated."""
    assert all(r.error is None for r in results)
    return np.concatenate([r.output.arrays["codes"] for r in results])


def alone(engine: StageEngine, data: StageData, seed: int) -> np.ndarray:
    """The codes of one request run on its own."""
    (result,) = engine.execute([EngineRequest("alone", seed, data)])
    assert result.error is None
    return result.output.arrays["codes"]  # type: ignore[no-any-return]
