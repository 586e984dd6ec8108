"""Capped exponential backoff with jitter, for retry loops of the client helpers."""

from __future__ import annotations

import random


class Backoff:
    """``next()`` gives initial, 2x, 4x, ... up to ``max_s`` (each +/- ``jitter``); ``reset()``."""

    def __init__(
        self, initial_s: float = 0.1, max_s: float = 5.0, factor: float = 2.0, jitter: float = 0.2
    ) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("need 0 < initial_s <= max_s")
        self.initial_s = initial_s
        self.max_s = max_s
        self.factor = factor
        self.jitter = jitter
        self._current = initial_s
        self.failures = 0

    def next(self) -> float:
        delay = self._current
        self._current = min(self._current * self.factor, self.max_s)
        self.failures += 1
        return delay * random.uniform(1 - self.jitter, 1 + self.jitter)

    def reset(self) -> None:
        self._current = self.initial_s
        self.failures = 0
