"""Rate-limited logging for failures that repeat on every request (Redis being down).

Without it, an outage writes a warning per request and per health probe (several a second);
with it, the first one is logged at once and then at most one per interval, carrying the
number of similar messages held back since the last one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["REDIS_UNAVAILABLE", "ThrottledLog"]


class ThrottledLog:
    """Logs a message at most once per ``interval_s``; counts the ones it holds back."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 5.0,
        *,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.level = level
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._held_back = 0

    def __call__(self, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless one was logged less than ``interval_s`` ago.

        Returns whether it was logged. A logged message ends with the count held back before it.
        """
        now = self._clock()
        with self._lock:
            if self._last is not None and now - self._last < self.interval_s:
                self._held_back += 1
                return False
            held_back, self._held_back, self._last = self._held_back, 0, now
        if held_back:
            msg = f"{msg} (and {held_back} similar in the last {self.interval_s:g}s)"
        self.logger.log(self.level, msg, *args)
        return True

    def reset(self) -> None:
        """Forget the last message: the next one is logged at once."""
        with self._lock:
            self._last, self._held_back = None, 0


REDIS_UNAVAILABLE = ThrottledLog(logging.getLogger("omni_mesh.control_plane.redis"), 5.0)
"""Every "Redis unavailable" warning of omni-cp's request handlers goes through this one."""
