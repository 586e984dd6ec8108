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
from types import TracebackType

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


def idle_core_shares(pids: list[int], window_s: float = 3.0) -> dict[int, float]:
    """The cores each of ``pids`` used over ``window_s``, after a second to settle (the
    last requests' stats and steps)."""
    time.sleep(1.0)
    before = {pid: cpu_s(pid) for pid in pids}
    time.sleep(window_s)
    return {pid: (cpu_s(pid) - t) / window_s for pid, t in before.items()}


class ClientLoad:
    """Client threads calling ``call(seed, stream)`` over ``seeds`` in turn (every other call
    streamed) until the block ends, ``pause_s`` between two calls of a thread; every call's
    (seed, answer), or (seed, the exception it raised)."""

    def __init__(
        self,
        call: Callable[[int, bool], str],
        seeds: Sequence[int],
        threads: int,
        pause_s: float = 0.0,
    ) -> None:
        self.call = call
        self.seeds = seeds
        self.pause_s = pause_s
        self.results: list[tuple[int, str | BaseException]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,)) for n in range(threads)]

    def _run(self, n: int) -> None:
        while not self._stop.is_set():
            seed = self.seeds[n % len(self.seeds)]
            try:
                self.results.append((seed, self.call(seed, n % 2 == 0)))
            except Exception as exc:  # counted as a failure by the test
                self.results.append((seed, exc))
            n += 1
            self._stop.wait(self.pause_s)

    def __enter__(self) -> ClientLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def failed(self) -> list[tuple[int, str | BaseException]]:
        return [r for r in self.results if not isinstance(r[1], str)]

    def wrong(self, expected: dict[int, str]) -> list[tuple[int, str | BaseException]]:
        return [r for r in self.results if r[1] != expected[r[0]]]


def kills_under_load(
    call: Callable[[int, bool], str],
    seeds: Sequence[int],
    victims: Sequence[list[int]],
    *,
    workers: int,
    pauses_s: Sequence[float],
) -> list[tuple[int, str | BaseException]]:
    """A :class:`ClientLoad` of ``workers`` threads while ``victims`` (pid lists) are
    SIGKILLed one after another: ``pauses_s[0]`` after the load starts, then ``pauses_s[i]``
    apart, the load stopping ``pauses_s[-1]`` after the last. Every call's result."""
    assert len(pauses_s) == len(victims) + 1
    with ClientLoad(call, seeds, workers) as load:
        for pause, pids in zip(pauses_s, victims, strict=False):
            time.sleep(pause)
            kill(pids)
        time.sleep(pauses_s[-1])
    return load.results
