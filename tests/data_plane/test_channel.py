from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator

import pytest

from omni_mesh.data_plane import messages as m
from omni_mesh.data_plane.channel import (
    MAX_FRAME,
    AsyncChannel,
    BlockingChannel,
    ChannelError,
    encode_frame,
    make_socketpair,
)

from .samples import ENGINE_MESSAGES

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Pair:
    """The sidecar end (async) and the engine end (blocking) of one channel."""

    def __init__(self, sidecar: AsyncChannel, engine: BlockingChannel) -> None:
        self.sidecar = sidecar
        self.engine = engine


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    parent, child = make_socketpair()
    sidecar = await AsyncChannel.open(parent)
    engine = BlockingChannel(child)
    yield Pair(sidecar, engine)
    await sidecar.close()
    engine.close()


def test_socketpair_inheritance() -> None:
    parent, child = make_socketpair()
    with parent, child:
        assert child.get_inheritable() and not parent.get_inheritable()
        assert parent.family == socket.AF_UNIX and parent.type == socket.SOCK_STREAM


async def test_every_message_both_ways(pair: Pair) -> None:
    for msg in ENGINE_MESSAGES:
        await pair.sidecar.send(msg)
    got = [await asyncio.to_thread(pair.engine.recv, 5) for _ in ENGINE_MESSAGES]
    assert got == ENGINE_MESSAGES

    def send_all() -> None:
        for msg in ENGINE_MESSAGES:
            pair.engine.send(msg)

    await asyncio.to_thread(send_all)
    assert [await pair.sidecar.recv() for _ in ENGINE_MESSAGES] == ENGINE_MESSAGES


async def test_eof_is_none_on_both_sides() -> None:
    parent, child = make_socketpair()
    sidecar = await AsyncChannel.open(parent)
    engine = BlockingChannel(child)
    engine.send(m.Fatal(message="bye"))
    engine.close()
    assert await sidecar.recv() == m.Fatal(message="bye")
    assert await sidecar.recv() is None
    await sidecar.close()

    parent, child = make_socketpair()
    sidecar = await AsyncChannel.open(parent)
    engine = BlockingChannel(child)
    await sidecar.send(m.Shutdown())
    await sidecar.close()
    assert engine.recv(timeout=5) == m.Shutdown()
    assert engine.recv(timeout=5) is None
    assert engine.recv() is None
    engine.close()


async def test_oversize_frames_are_refused_before_sending(pair: Pair) -> None:
    huge = m.Fatal(message="x" * (MAX_FRAME + 1))
    with pytest.raises(ChannelError, match="exceeds the 16777216-byte limit"):
        await pair.sidecar.send(huge)
    with pytest.raises(ChannelError, match="exceeds"):
        pair.engine.send(huge)
    await pair.sidecar.send(m.Abort(key="still-usable"))
    assert await asyncio.to_thread(pair.engine.recv, 5) == m.Abort(key="still-usable")


def test_oversize_length_prefix_is_refused_by_the_blocking_reader() -> None:
    raw, child = socket.socketpair()
    with raw, BlockingChannel(child, max_frame=1024) as engine:
        raw.sendall(struct.pack(">I", 1025) + b"x" * 10)
        with pytest.raises(ChannelError, match="1025-byte frame, over the 1024-byte limit"):
            engine.recv(timeout=5)


async def test_oversize_length_prefix_is_refused_by_the_async_reader() -> None:
    parent, raw = socket.socketpair()
    sidecar = await AsyncChannel.open(parent, max_frame=1024)
    with raw:
        raw.sendall(struct.pack(">I", 1 << 30))
        with pytest.raises(ChannelError, match="over the 1024-byte limit"):
            await sidecar.recv()
    await sidecar.close()


def test_close_wakes_a_blocked_reader() -> None:
    parent, child = make_socketpair()
    engine = BlockingChannel(child)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(engine.recv()))
    reader.start()
    time.sleep(0.05)
    engine.close()
    reader.join(5)
    parent.close()
    assert not reader.is_alive() and got == [None]


def test_blocking_recv_times_out_and_keeps_partial_frames() -> None:
    raw, child = socket.socketpair()
    with raw, BlockingChannel(child) as engine:
        with pytest.raises(TimeoutError):
            engine.recv(timeout=0.05)
        frame = bytes(encode_frame(m.Abort(key="r1")))
        raw.sendall(frame[:3])
        with pytest.raises(TimeoutError):
            engine.recv(timeout=0.05)
        raw.sendall(frame[3:] + frame)
        assert engine.recv(timeout=0) == m.Abort(key="r1")
        assert engine.recv(timeout=0) == m.Abort(key="r1")


def test_malformed_and_truncated_frames() -> None:
    raw, child = socket.socketpair()
    with raw, BlockingChannel(child) as engine:
        raw.sendall(struct.pack(">I", 3) + b"\x81\xa1x")  # a map, not a tagged message
        with pytest.raises(ChannelError, match="malformed frame from peer"):
            engine.recv(timeout=5)
        raw.sendall(struct.pack(">I", 100) + b"abc")
        raw.close()
        with pytest.raises(ChannelError, match="peer closed mid-frame"):
            engine.recv(timeout=5)


async def test_async_truncated_frame() -> None:
    parent, raw = socket.socketpair()
    sidecar = await AsyncChannel.open(parent)
    raw.sendall(struct.pack(">I", 100) + b"abc")
    raw.close()
    with pytest.raises(ChannelError, match="expected 100 bytes"):
        await sidecar.recv()
    await sidecar.close()


async def test_send_to_a_closed_peer_is_a_channel_error() -> None:
    parent, child = make_socketpair()
    sidecar = await AsyncChannel.open(parent)
    engine = BlockingChannel(child)
    await sidecar.close()
    with pytest.raises(ChannelError, match="peer gone"):
        for _ in range(100):  # the first sends may still be buffered by the kernel
            engine.send(m.Stats(queued=0, running=0, batch_size=0, step_ms=0.0, steps=0))
    engine.close()


async def test_concurrent_senders_never_interleave(pair: Pair) -> None:
    big = "y" * 300_000  # larger than a socket buffer: sendall takes several writes
    n_threads, per_thread = 4, 20

    def sender(i: int) -> None:
        for j in range(per_thread):
            pair.engine.send(m.Fatal(message=f"{i}-{j}-{big}"))

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    got = [await pair.sidecar.recv() for _ in range(n_threads * per_thread)]
    for t in threads:
        t.join()
    messages = [g.message for g in got if isinstance(g, m.Fatal)]
    assert len(messages) == n_threads * per_thread
    assert all(msg.endswith(big) for msg in messages)
    assert {msg.split("-", 2)[0] for msg in messages} == {str(i) for i in range(n_threads)}
