"""benchmarks.measure.cpu_seconds counts the CPU of threads that have already exited."""

from __future__ import annotations

import os
import threading
import time

import pytest

from benchmarks.measure import cpu_seconds

pytestmark = pytest.mark.unit


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_of_an_exited_thread_is_counted() -> None:
    before = cpu_seconds(os.getpid())
    worker = threading.Thread(target=_burn, args=(0.3,))
    worker.start()
    worker.join()
    assert cpu_seconds(os.getpid()) - before >= 0.25
