"""Closed-loop load generation with aiohttp on uvloop, bounded in count and in time.

``concurrency`` workers each send one request, wait for its answer and send the next. Every
request's start and end are recorded; the figures come from requests that *completed inside
the measurement window* (after a warm-up), so ramp-up and drain do not distort throughput.
Only 127.0.0.1 is ever targeted (the callers build loopback URLs).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from benchmarks.measure import percentile

#: One request: raises on failure (any exception counts as an error).
RequestFn = Callable[[aiohttp.ClientSession, int], Awaitable[None]]

MAX_ERRORS_KEPT = 5
MAX_FAILURES = 200  # failed requests (and none succeeded) after which a run gives up


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)  # seconds, completed in window
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    window_s: float = 0.0
    sent: int = 0

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def throughput(self) -> float:
        return self.completed / self.window_s if self.window_s > 0 else math.nan

    def p(self, q: float) -> float:
        return percentile(self.latencies, q)

    def check(self, what: str) -> None:
        if self.errors:
            raise RuntimeError(
                f"{what}: {self.errors} failed requests, e.g. {'; '.join(self.error_samples)}"
            )
        if not self.latencies:
            raise RuntimeError(f"{what}: no request completed in the measurement window")


def new_session(connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=connections, limit_per_host=connections, force_close=False
    )
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))


class _Window:
    """Which requests count: those that finished while the window was open (throughput is
    completions per second of window); stops the load once ``requests`` of them succeeded."""

    def __init__(self, result: LoadResult, requests: int | None) -> None:
        self.result = result
        self.requests = requests
        self.start: float | None = None
        self.end: float | None = None
        self.stop = asyncio.Event()

    def record(self, t0: float, t1: float, error: str | None) -> None:
        if self.start is None or t1 < self.start or self.end is not None:
            return
        res = self.result
        res.sent += 1
        if error is None:
            res.latencies.append(t1 - t0)
            if self.requests is not None and len(res.latencies) >= self.requests:
                self.stop.set()
            return
        res.errors += 1
        if len(res.error_samples) < MAX_ERRORS_KEPT:
            res.error_samples.append(error[:300])


async def run_load(
    fn: RequestFn,
    *,
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    warmup_s: float = 0.0,
    session: aiohttp.ClientSession | None = None,
    on_window: Callable[[bool], None] | None = None,
) -> LoadResult:
    """Run ``fn`` from ``concurrency`` workers.

    Time-bounded (``duration_s`` after ``warmup_s``) or count-bounded (``requests`` measured
    after ``warmup_s``), whichever is given; with both, whichever ends first. ``on_window`` is
    called with True when the window opens and False when it closes (for CPU meters)."""
    if duration_s is None and requests is None:
        raise ValueError("give duration_s or requests")
    sess = session or new_session(concurrency)
    result = LoadResult()
    window = _Window(result, requests)
    counter = iter(range(1 << 62))
    failures: list[str] = []
    hard_deadline = time.monotonic() + warmup_s + (duration_s or 600.0) + 60.0

    async def worker() -> None:
        while not window.stop.is_set() and time.monotonic() < hard_deadline:
            i = next(counter)
            t0 = time.monotonic()
            error: str | None = None
            try:
                await fn(sess, i)
            except Exception as exc:  # every failure is counted, the load goes on
                error = f"{type(exc).__name__}: {exc}"
            window.record(t0, time.monotonic(), error)
            if error is not None:
                failures.append(error)
                if len(failures) >= MAX_FAILURES and not result.latencies:
                    window.stop.set()  # nothing but errors: give up instead of spinning
                await asyncio.sleep(0.001)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        if warmup_s:
            await asyncio.sleep(warmup_s)
        window.start = time.monotonic()
        if on_window is not None:
            on_window(True)
        timeout = duration_s if duration_s is not None else hard_deadline - window.start
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(window.stop.wait(), timeout)
        window.end = time.monotonic()
        if on_window is not None:
            on_window(False)
        window.stop.set()
        result.window_s = window.end - window.start
        await asyncio.wait(tasks, timeout=30)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if session is None:
            await sess.close()
    return result


async def expect_ok(resp: aiohttp.ClientResponse) -> bytes:
    body = await resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {body[:200]!r}")
    return body
