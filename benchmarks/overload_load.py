"""The loads of the overload benchmark and what each level measured (:class:`Run`): closed
loops of aiohttp clients, and open-loop levels from :mod:`benchmarks.openloop`."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import aiohttp

from benchmarks.measure import percentile
from benchmarks.openloop import OpenLoopResult, open_loop

TIMEOUT_S = 60  # the deployment's request_timeout_s
OPEN_CONNS = 1500  # open loop: keep-alive connections opened before the first arrival
MAX_CONNS = 4000  # past these, an arrival waits in the generator (its latency counts)
#: The class set in a header, as a gateway in front would: the API server sheds on headers.
OPEN_HEADERS = {"X-Omni-Priority": "normal"}


@dataclass
class Run:
    """One load level: every answer's (send time, latency, status), times from the start of
    the window; the figures count the answers that arrived inside the window."""

    label: str
    window_s: float = 0.0
    answers: list[tuple[float, float, int]] = field(default_factory=list)
    lost: int = 0
    lost_samples: list[str] = field(default_factory=list)
    offered_s: float = 0.0  # open loop: how long arrivals were sent (every answer counts)
    reasons: dict[str, float] = field(default_factory=dict)  # the API server's sheds by reason
    generator: str = ""  # open loop: what the generator cost and how late it sent
    queue_sheds: list[float] = field(default_factory=list)  # open loop: shed after waiting
    gc_slow: list[int] = field(default_factory=list)  # API server's GC passes > 10 ms by gen
    gc_longest: float = 0.0  # upper bound of its longest GC pass, seconds

    def _in_window(self, statuses: tuple[int, ...]) -> list[float]:
        end = self.window_s
        return [lat for t, lat, st in self.answers if st in statuses and 0 <= t + lat <= end]

    def ok(self) -> list[float]:
        return self._in_window((200,))

    def shed(self) -> list[float]:
        return self._in_window((429, 503))

    @property
    def goodput(self) -> float:
        """200s per second of the window (open loop: from the first arrival to the last
        answer, so that a backlog drained after the arrivals stopped is not counted faster)."""
        return len(self.ok()) / self.seconds if self.seconds else math.nan

    @property
    def seconds(self) -> float:
        if not self.offered_s:
            return self.window_s
        return max([self.offered_s, *(t + lat for t, lat, _ in self.answers)])

    def lose(self, why: str) -> None:
        self.lost += 1
        if len(self.lost_samples) < 3:
            self.lost_samples.append(why[:200])


async def _one(sess: aiohttp.ClientSession, url: str, i: int, run: Run, t_start: float) -> None:
    t0 = time.monotonic()
    try:
        async with sess.post(url, json={"prompt": "x", "seed": i}) as resp:
            body = await resp.read()
            status = resp.status
    except Exception as exc:  # every failure is counted as lost
        run.lose(f"{type(exc).__name__}: {exc}")
        return
    if status == 200 or (status in (429, 503) and b'"shed"' in body):
        run.answers.append((t0 - t_start, time.monotonic() - t0, status))
    else:
        run.lose(f"HTTP {status}: {body[:150]!r}")


def _session(n: int) -> aiohttp.ClientSession:
    conn = aiohttp.TCPConnector(limit=n, limit_per_host=n)
    return aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S + 30)
    )


async def closed_loop(
    url: str, clients: int, warmup_s: float, measure_s: float, path: str = "/v1/generate"
) -> Run:
    """``clients`` workers, each sending its next request when its last one was answered,
    until the window closes; the figures are those of the answers inside the window."""
    run = Run(f"{clients} clients", window_s=measure_s)
    measure_from = time.monotonic() + warmup_s
    stop_at = measure_from + measure_s
    counter = iter(range(1 << 62))
    async with _session(clients) as sess:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                await _one(sess, url + path, next(counter), run, measure_from)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return run


async def open_level(port: int, rps: float, seconds: float) -> Run:
    """Arrivals every 1/rps seconds for ``seconds`` (:mod:`benchmarks.openloop`: latency
    from the scheduled send time); every answer awaited."""
    res = await open_loop(
        port,
        rps,
        seconds,
        conns=OPEN_CONNS,
        max_conns=MAX_CONNS,
        timeout_s=TIMEOUT_S + 30,
        headers=OPEN_HEADERS,
    )
    return _from_open(res, f"{rps:.0f}/s", seconds)


def _from_open(res: OpenLoopResult, label: str, seconds: float) -> Run:
    run = Run(label, window_s=seconds + TIMEOUT_S, offered_s=seconds)
    answered = zip(res.scheduled, res.latency, res.status, strict=True)
    run.answers = [(t, lat, st) for t, lat, st in answered if st > 0]
    run.queue_sheds = [res.latency[i] for i in sorted(res.expired)]
    for why in res.lost:
        run.lose(why)
    lag = sorted(res.send_lag)
    run.generator = (
        f"{res.cpu_s / res.wall_s:.2f} CPU over {res.wall_s:.0f} s, sends late by p99 "
        f"{percentile(lag, 99) * 1000:.1f} ms (max {lag[-1] * 1000:.1f}), "
        f"{res.connections} connections"
    )
    return run
