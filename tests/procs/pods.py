"""The processes of ``omni-up``'s stage pods, for tests that kill or watch one: a pod (found by
the port in its argv) with its engine, SIGKILL of a list of pids, a process's CPU seconds, and
kills under a load of client threads."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.procs.polling import descendants


def pod_and_engine(up_pid: int, url: str) -> list[int]:
    """The pids of the pod listening at ``url`` (a descendant of ``up_pid``) and of its
    children (its engine)."""
    port = url.rsplit(":", 1)[1]
    for pid in descendants(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "omni_mesh.sidecar.cli_stage" in " ".join(argv) and port in argv:
            return [pid, *descendants(pid)]
    raise AssertionError(f"no pod at {url}")


def engine_pids(up_pid: int, urls: list[str]) -> list[int]:
    """The engine processes of the pods at ``urls``."""
    return [
        pid
        for url in urls
        for pid in pod_and_engine(up_pid, url)[1:]
        if b"omni_mesh.engines" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kills_under_load(
    call: Callable[[int, bool], str],
    seeds: Sequence[int],
    victims: Sequence[list[int]],
    *,
    workers: int,
    pauses_s: Sequence[float],
) -> list[tuple[int, str | BaseException]]:
    """``workers`` threads call ``call(seed, stream)`` over ``seeds`` in turn (every other call
    streamed) while ``victims`` (pid lists) are SIGKILLed one after another: ``pauses_s[0]``
    after the load starts, then ``pauses_s[i]`` apart, the load stopping ``pauses_s[-1]`` after
    the last. Every call's (seed, answer), or (seed, the exception it raised)."""
    assert len(pauses_s) == len(victims) + 1
    results: list[tuple[int, str | BaseException]] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        n = worker
        while not stop.is_set():
            seed = seeds[n % len(seeds)]
            try:
                results.append((seed, call(seed, n % 2 == 0)))
            except Exception as exc:  # the caller counts it as a failure
                results.append((seed, exc))
            n += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    try:
        for pause, pids in zip(pauses_s, victims, strict=False):
            time.sleep(pause)
            kill(pids)
        time.sleep(pauses_s[-1])
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    return results
