"""Multi-host tests: a leftover sweep at session start (namespaces of a killed session), and
the one :class:`~tests.multihost.fabric.Fabric` that every scenario module shares (each test
waits for the pool it needs and heals the faults it made before it ends)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multihost.fabric import Fabric
from tests.multihost.hosts import available, sweep_leftovers


@pytest.fixture(scope="session", autouse=True)
def _sweep_test_hosts() -> None:
    if available() is None:
        sweep_leftovers()


@pytest.fixture(scope="package")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    """The 1:2:1 deployment over four test hosts, started once for the multi-host modules."""
    fab = Fabric(tmp_path_factory.mktemp("multihost"))
    try:
        yield fab
    finally:
        fab.close()
