"""Tensor (or pipeline) parallel vLLM on CPU: one worker process per rank, each bound to its own
CPUs.

vLLM's CPU workers bind their OpenMP threads to one NUMA node each unless told otherwise
(``VLLM_CPU_OMP_THREADS_BIND``), and refuse to start with fewer allowed NUMA nodes than ranks, as
on a one-node machine. Where the variable is not set, the stage splits the CPUs its process may
run on (its affinity: a replica's slice on a shared host) into one contiguous group per rank. A
GPU platform binds nothing here.

The CPU workers' communicator makes shared-memory segments (``/dev/shm/vllm_dist_<id>-…``) that
nothing unlinks when the workers stop. :class:`WorkerSegments` notes the ones that appeared while
the engine started, unlinks them when it closes, and lists them in the engine's temp folder,
whose sidecar unlinks them when the engine dies (``engine_link/tmp_dirs.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omni_mesh.data_plane.constants import ENGINE_SEGMENTS_FILE, ENGINE_TMP_ENV
from omni_mesh.data_plane.shm_common import SHM_DIR
from omni_mesh.engines.base import EngineConfigError

logger = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_groups(cpus: list[int], ranks: int) -> str:
    """``cpus`` split into ``ranks`` contiguous groups, in vLLM's ``"0-3|4-7"`` form (a group of
    non-adjacent CPUs as a comma list)."""
    if ranks < 1 or len(cpus) < ranks:
        raise ValueError(f"{len(cpus)} CPU(s) for {ranks} rank(s)")
    cpus = sorted(cpus)
    size, extra = divmod(len(cpus), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < extra)
        group = cpus[start:end]
        contiguous = group == list(range(group[0], group[-1] + 1))
        groups.append(
            f"{group[0]}-{group[-1]}"
            if contiguous and len(group) > 1
            else ",".join(str(c) for c in group)
        )
        start = end
    return "|".join(groups)


def bind_cpu_workers(ranks: int, where: str) -> None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers (module docstring); a
    :class:`EngineConfigError` naming ``tensor_parallel_size`` when there are fewer CPUs."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu" or os.environ.get(BIND_ENV):
        return
    cpus = sorted(os.sched_getaffinity(0))
    try:
        os.environ[BIND_ENV] = cpu_groups(cpus, ranks)
    except ValueError as exc:
        raise EngineConfigError(
            f"{where}: tensor_parallel_size x pipeline_parallel_size = {ranks} CPU workers, but "
            f"this process may run on {len(cpus)} CPU(s) ({exc}); lower the parallel sizes or "
            f"set {BIND_ENV}"
        ) from None
    logger.info("%s: %d CPU workers bound to %s", where, ranks, os.environ[BIND_ENV])


class WorkerSegments:
    """The ``vllm_dist_*`` segments made while the engine starts (module docstring)."""

    PATTERN = "vllm_dist_*"

    def __init__(self) -> None:
        self._before = self._present()
        self.names: list[str] = []

    def started(self) -> None:
        """The engine is up: note what appeared, for :meth:`unlink` and the sidecar."""
        self.names = sorted(self._present() - self._before)
        tmp = os.environ.get(ENGINE_TMP_ENV)
        if self.names and tmp:
            (Path(tmp) / ENGINE_SEGMENTS_FILE).write_text("".join(f"{n}\n" for n in self.names))

    def unlink(self) -> None:
        for name in self.names:
            Path(SHM_DIR, name).unlink(missing_ok=True)
        self.names = []

    def _present(self) -> set[str]:
        return {path.name for path in Path(SHM_DIR).glob(self.PATTERN)}
