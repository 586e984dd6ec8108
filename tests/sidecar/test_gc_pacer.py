"""The collector's pacer (``sidecar/gc_pacer.py``) on a real collector: full passes only when
idle or after a busy interval, survivors of a busy pass frozen until the next idle moment, the
frozen part collected at the cap, young passes on a ticker while the pod holds work, every pass
timed, and ``0`` leaving CPython's thresholds.

Each scenario (``tests/sidecar/gc_scenarios.py``) runs in a process of its own: the pacer
freezes, re-thresholds and hooks the collector of its process, and the test session's own
must stay as CPython made it (a collector callback left in it once turned a later failure's
report into pytest's INTERNALERROR)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.sidecar.gc_scenarios import SCENARIOS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_pacer_on_a_real_collector(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.sidecar.gc_scenarios", name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"scenario {name}: ok" in done.stdout
