"""The control channel across a real process boundary (socketpair + pass_fds)."""

from __future__ import annotations

import asyncio
import os

import pytest

from omni_mesh.data_plane import messages as m
from omni_mesh.data_plane.channel import AsyncChannel, make_socketpair
from omni_mesh.data_plane.codec import encode

from .children import ENGINE, start
from .samples import sample_stage_input

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_engine_process_round_trip_and_eof() -> None:
    parent, child = make_socketpair()
    with start(ENGINE, str(child.fileno()), pass_fds=[child.fileno()]) as proc:
        child.close()
        chan = await AsyncChannel.open(parent)
        try:
            hello = await asyncio.wait_for(chan.recv(), 30)
            assert hello == m.Hello(pid=proc.pid, shm_prefix="omni-test")
            si = sample_stage_input()
            await chan.send(m.Submit(stage_input=si))
            result = await asyncio.wait_for(chan.recv(), 10)
            assert isinstance(result, m.Result)
            assert result.output.request_id == si.request_id
            assert result.output.final is not None
            assert encode(result.output.final) == encode(si.payload)
            await chan.send(m.Shutdown())
            assert await asyncio.wait_for(chan.recv(), 10) is None  # engine exited: EOF
            assert await asyncio.to_thread(proc.wait, 10) == 0
        finally:
            await chan.close()


async def test_engine_death_is_eof() -> None:
    parent, child = make_socketpair()
    with start(ENGINE, str(child.fileno()), pass_fds=[child.fileno()]) as proc:
        child.close()
        chan = await AsyncChannel.open(parent)
        try:
            assert isinstance(await asyncio.wait_for(chan.recv(), 30), m.Hello)
            os.kill(proc.pid, 9)
            assert await asyncio.wait_for(chan.recv(), 10) is None
            await asyncio.to_thread(proc.wait, 10)
        finally:
            await chan.close()
