"""Open-loop load that is not its own bottleneck, and CPU pinning for it.

Arrivals are scheduled at a fixed rate whatever the answers do. A request's latency runs from
its *scheduled* send time, so a generator that falls behind, or a request that waits for a
free connection, shows up as latency instead of being hidden (no coordinated omission).

One asyncio protocol per keep-alive connection, opened before the first arrival; a request is
prebuilt bytes written to an idle connection, its answer parsed from the raw bytes (status,
``Content-Length``, body): some tens of microseconds of CPU per request, where aiohttp's
client spends several hundred and opens a connection per outstanding request. When every
connection is busy a new one is opened (up to ``max_conns``); past that the arrival waits in
the generator (its latency still counts from its scheduled time). A request is lost only when
it gets no answer (its connection failed, or ``timeout_s`` passed).

:func:`split_cpus` gives the generator its own CPU and the pipeline the rest, so that the two
do not compete for the same cores (``os.sched_setaffinity``; children inherit it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

LOCALHOST = "127.0.0.1"
OPEN_BATCH = 100  # connections opened at once before the first arrival


@dataclass
class OpenLoopResult:
    """Per request: scheduled send time (s from the first arrival), latency from it (s) and
    status (200 or a shed 429/503; negative when lost, with the reason in ``lost``); and what
    the generator itself cost."""

    scheduled: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    expired: set[int] = field(default_factory=set)  # sheds after waiting in a queue
    send_lag: list[float] = field(default_factory=list)  # written minus scheduled (s)
    cpu_s: float = 0.0  # the generator's CPU time over the level
    wall_s: float = 0.0
    connections: int = 0


class _Conn(asyncio.Protocol):
    """One keep-alive connection: one request at a time."""

    def __init__(self, gen: OpenLoop) -> None:
        self.gen = gen
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.pending = -1  # the request it carries, -1 when idle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, i: int, data: bytes) -> None:
        assert self.transport is not None
        self.pending = i
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return
        length = _content_length(bytes(buf[:end]).lower())
        if len(buf) < end + 4 + length:
            return
        status = int(buf[9:12])
        body = bytes(buf[end + 4 : end + 4 + length])
        del buf[: end + 4 + length]
        i, self.pending = self.pending, -1
        self.gen.answered(self, i, status, body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gen.dropped(self, f"connection lost: {exc}")


def _content_length(head: bytes) -> int:
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : end if end >= 0 else len(head)])


class OpenLoop:
    """``rate`` arrivals per second for ``seconds`` to ``POST path`` on 127.0.0.1:``port``."""

    def __init__(
        self,
        port: int,
        path: str,
        body: bytes,
        *,
        conns: int,
        max_conns: int,
        timeout_s: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.head = (
            f"POST {path} HTTP/1.1\r\nHost: {LOCALHOST}:{port}\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.conns = conns
        self.max_conns = max_conns
        self.timeout_s = timeout_s
        self.idle: deque[_Conn] = deque()
        self.all: set[_Conn] = set()
        self.opening = 0
        self.waiting: deque[int] = deque()
        self.t0 = 0.0
        self.result = OpenLoopResult()
        self.open_count = 0  # requests without an answer yet
        self.done = asyncio.Event()
        self._all_sent = False

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        self.opening += 1
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self), LOCALHOST, self.port)
        except OSError as exc:
            self.result.lost.append(f"connect: {exc}")
            return
        finally:
            self.opening -= 1
        self.all.add(conn)
        self.idle.append(conn)
        self._dispatch()

    def _dispatch(self) -> None:
        res = self.result
        while self.waiting and self.idle:
            i = self.waiting.popleft()
            res.send_lag[i] = time.monotonic() - self.t0 - res.scheduled[i]
            self.idle.popleft().send(i, self.head)
        missing = len(self.waiting) - self.opening
        while missing > 0 and len(self.all) + self.opening < self.max_conns:
            asyncio.get_running_loop().create_task(self._connect())
            missing -= 1

    def answered(self, conn: _Conn, i: int, status: int, body: bytes) -> None:
        res = self.result
        if i >= 0 and res.status[i] == 0:
            res.latency[i] = time.monotonic() - self.t0 - res.scheduled[i]
            shed = status in (429, 503) and b'"shed"' in body
            res.status[i] = status if status == 200 or shed else -status  # < 0: lost
            if shed and (b"without a slot" in body or b"while it waited" in body):
                res.expired.add(i)  # admission_queue's messages for a waiter shed late
            if res.status[i] < 0:
                res.lost.append(f"HTTP {status}: {body[:150]!r}")
            self._finished()
        self.idle.append(conn)
        self._dispatch()

    def dropped(self, conn: _Conn, why: str) -> None:
        self.all.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        i = conn.pending
        if i >= 0 and self.result.status[i] == 0:
            self.result.status[i] = -1
            self.result.lost.append(why)
            self._finished()

    def _finished(self) -> None:
        self.open_count -= 1
        if self.open_count == 0 and self.t0 and self._all_sent:
            self.done.set()

    async def run(self, rate: float, seconds: float) -> OpenLoopResult:
        for start in range(0, self.conns, OPEN_BATCH):
            batch = min(OPEN_BATCH, self.conns - start)
            await asyncio.gather(*(self._connect() for _ in range(batch)))
        res = self.result
        n = int(rate * seconds)
        res.scheduled = [i / rate for i in range(n)]
        res.latency = [0.0] * n
        res.status = [0] * n
        res.send_lag = [0.0] * n
        self.open_count = n
        cpu0 = time.process_time()
        self.t0 = t0 = time.monotonic()
        i = 0
        while i < n:
            now = time.monotonic() - t0
            while i < n and res.scheduled[i] <= now:  # every arrival whose time has come
                self.waiting.append(i)
                i += 1
            self._dispatch()
            if i < n:
                await asyncio.sleep(max(0.0, res.scheduled[i] - (time.monotonic() - t0)))
        self._all_sent = True
        if self.open_count:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), self.timeout_s)
        res.cpu_s = time.process_time() - cpu0
        res.wall_s = time.monotonic() - t0
        res.connections = len(self.all)
        for k, st in enumerate(res.status):
            if st == 0:
                res.status[k] = -1
                res.lost.append(f"no answer within {self.timeout_s:g} s")
        for conn in list(self.all):
            if conn.transport is not None:
                conn.transport.close()
        return res


async def open_loop(
    port: int,
    rate: float,
    seconds: float,
    *,
    path: str = "/v1/generate",
    body: bytes = b'{"prompt": "x"}',
    conns: int = 1000,
    max_conns: int = 4000,
    timeout_s: float = 90.0,
    headers: dict[str, str] | None = None,
) -> OpenLoopResult:
    gen = OpenLoop(
        port, path, body, conns=conns, max_conns=max_conns, timeout_s=timeout_s, headers=headers
    )
    return await gen.run(rate, seconds)


# ---- CPU pinning --------------------------------------------------------------------------


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(the pipeline's CPUs, the generator's CPU): the last allowed CPU for the generator,
    the others for the pipeline; None with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return set(cpus[:-1]), {cpus[-1]}


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """This process on ``cpus`` while inside (processes it starts inherit them), then back."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` on ``cpus`` (a process's own affinity call moves
    only its calling thread; threads started later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)


def child_pids(pid: int) -> list[int]:
    """The process ids of the direct children of ``pid``."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
