"""A real ``omni-up`` for tests that deploy a whole pipeline: started with a deploy file, ready,
stopped with Ctrl-C at the end; its pods' URLs by pool, read off its endpoint lines."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omni_mesh.procutil import free_port
from tests.procs.managed import ManagedProcess
from tests.procs.polling import clean_env


@contextmanager
def omni_up(
    pipeline: str, deploy: Path, log_dir: Path, *, secret: str, timeout_s: float = 240.0
) -> Iterator[tuple[ManagedProcess, str]]:
    """(the omni-up process, its API server's URL) once ``omni-up ready``."""
    port = free_port()
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", pipeline,
            "--port", str(port), "--deploy-config", str(deploy), "--secret", secret]  # fmt: skip
    proc = ManagedProcess(argv, name="omni-up", env=clean_env(), log_dir=log_dir).start()
    try:
        proc.wait_for_output(r"omni-up ready", timeout=timeout_s)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.interrupt(timeout=60)


def stage_pools(stdout: str, stage_id: int, name: str) -> dict[str, list[str]]:
    """The URLs of stage ``stage_id`` (named ``name``)'s pods by pool: ``prefill`` and
    ``decode`` for a split stage, ``""`` otherwise."""
    pools: dict[str, list[str]] = {}
    pattern = rf"stage {stage_id} {re.escape(name)}(\S*) #\d+\s+(http://\S+)"
    for pool, url in re.findall(pattern, stdout):
        pools.setdefault(pool.removeprefix("-"), []).append(url)
    return pools
