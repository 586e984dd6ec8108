"""AsyncChannel.listen: every message handed to a callback in the read callback (the engine
client's receive path), in order, then None at EOF or the ChannelError that broke it."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from omni_mesh.data_plane import messages as m
from omni_mesh.data_plane.channel import (
    AsyncChannel,
    BlockingChannel,
    ChannelError,
    Delivery,
    make_socketpair,
)

from .samples import ENGINE_MESSAGES

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Collector:
    def __init__(self) -> None:
        self.got: list[Delivery] = []
        self.ended = asyncio.Event()

    def __call__(self, item: Delivery) -> None:
        self.got.append(item)
        if item is None or isinstance(item, ChannelError):
            self.ended.set()


async def test_messages_before_and_after_listen_arrive_in_order_then_eof() -> None:
    parent, child = make_socketpair()
    sidecar = await AsyncChannel.open(parent)
    engine = BlockingChannel(child)
    engine.send(ENGINE_MESSAGES[0])
    assert await sidecar.recv() == ENGINE_MESSAGES[0]  # recv first (the handshake)...
    engine.send(ENGINE_MESSAGES[1])
    await asyncio.sleep(0.05)  # ...one more read before listening: delivered first
    collect = Collector()
    sidecar.listen(collect)
    for msg in ENGINE_MESSAGES[2:]:
        engine.send(msg)
    engine.close()
    await asyncio.wait_for(collect.ended.wait(), 5)
    assert collect.got == [*ENGINE_MESSAGES[1:], None]
    await sidecar.close()


async def test_a_malformed_frame_ends_the_listening_with_a_channel_error() -> None:
    parent, raw = socket.socketpair()
    sidecar = await AsyncChannel.open(parent)
    collect = Collector()
    sidecar.listen(collect)
    with raw:
        raw.sendall(struct.pack(">I", 3) + b"\x81\xa1x")  # a map, not a tagged message
        await asyncio.wait_for(collect.ended.wait(), 5)
    [error] = collect.got
    assert isinstance(error, ChannelError) and "malformed frame" in str(error)
    await sidecar.close()


async def test_a_listener_that_raises_does_not_stop_the_channel() -> None:
    parent, child = make_socketpair()
    sidecar = await AsyncChannel.open(parent)
    engine = BlockingChannel(child)
    collect = Collector()

    def flaky(item: Delivery) -> None:
        collect(item)
        if isinstance(item, m.Abort):
            raise RuntimeError("consumer bug")

    sidecar.listen(flaky)
    engine.send(m.Abort(key="a"))
    engine.send(m.Release(key="b"))
    engine.close()
    await asyncio.wait_for(collect.ended.wait(), 5)
    assert collect.got == [m.Abort(key="a"), m.Release(key="b"), None]
    await sidecar.close()
