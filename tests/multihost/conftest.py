"""Multi-host tests: a leftover sweep at session start (namespaces of a killed session)."""

from __future__ import annotations

import pytest

from tests.multihost.hosts import available, sweep_leftovers


@pytest.fixture(scope="session", autouse=True)
def _sweep_test_hosts() -> None:
    if available() is None:
        sweep_leftovers()
