"""The engine process streaming (``--async-chunk``), through :class:`EngineClient`: a request
comes back as several Results over shared memory, running streams share ``max_num_seqs`` with
new work, an abort stops a stream mid-way, and a drain finishes the streams. The fixture fails
any test that leaves a ``/dev/shm`` segment behind.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from omni_mesh.data_plane.messages import Payload, StageInput, StageOutput, transfer_key
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.synthetic import chunk_bytes
from omni_mesh.sidecar.engine_link.client import EngineBusyError
from tests.engines.process_helpers import MakeClient, MiB, RecordingClient, shm_files, stage_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SALT = "synthetic/0"


def whole_input(request_id: str, seed: int = 1) -> StageInput:
    return StageInput(
        pipeline="synthetic",
        request_id=request_id,
        stage_id=0,
        deadline_ms=int((time.time() + 60) * 1000),
        seed=seed,
        payload=Payload(fields={"prompt": "p"}),
    )


async def collect(
    client: RecordingClient, si: StageInput, log: list[tuple[str, int, float]] | None = None
) -> list[StageOutput]:
    outs = []
    async for out in client.stream(si):
        outs.append(out)
        if log is not None:
            log.append((out.request_id, out.chunk, time.monotonic()))
    return outs


async def test_a_whole_input_comes_back_as_chunks_through_shared_memory(
    make_client: MakeClient,
) -> None:
    config = stage_config(0, output_bytes=2 * MiB, output_chunks=4, step_latency_ms=40)
    client = await make_client(config, stage_id=0, async_chunk=True)
    arrivals: list[tuple[str, int, float]] = []
    started = time.monotonic()
    outs = await collect(client, whole_input("s", seed=5), arrivals)
    assert [(o.error, o.chunk, o.last) for o in outs] == [
        (None, 0, False),
        (None, 1, False),
        (None, 2, False),
        (None, 3, True),
    ]
    # One chunk per step: the first arrives after one step, long before the last.
    assert arrivals[0][2] - started < arrivals[-1][2] - started - 0.08
    for c, out in enumerate(outs):
        (nxt,) = out.next
        assert (nxt.stage_id, nxt.chunk, nxt.last, nxt.request_id) == (1, c, c == 3, "s")
        tensor = nxt.payload.tensors["data"]
        assert tensor.shm is not None and tensor.shm.segment.startswith(client.engine_prefix or "")
        data = array_from_tensor(tensor, client.reader)
        assert data.tobytes() == chunk_bytes(5, SALT, c, MiB // 2).tobytes()
    assert len(shm_files(client.engine_prefix)) == 4  # every chunk held until the release
    client.release("s")
    again = await asyncio.wait_for(collect(client, whole_input("t")), 5.0)
    assert len(again) == 4
    assert len(shm_files(client.engine_prefix)) == 4  # the released slots were reused
    client.release("t")


async def test_running_streams_count_against_max_num_seqs(make_client: MakeClient) -> None:
    config = stage_config(0, max_num_seqs=2, output_bytes=64, output_chunks=3, step_latency_ms=40)
    client = await make_client(config, stage_id=0, async_chunk=True)
    log: list[tuple[str, int, float]] = []
    results = await asyncio.gather(
        *(collect(client, whole_input(f"r{i}", seed=i), log) for i in range(3))
    )
    for i, outs in enumerate(results):
        assert [o.chunk for o in outs] == [0, 1, 2] and outs[-1].last
        data = array_from_tensor(outs[1].next[0].payload.tensors["data"])
        assert data.tobytes() == chunk_bytes(i, SALT, 1, 21).tobytes()
        client.release(f"r{i}")
    first_chunk = {rid: t for rid, chunk, t in log if chunk == 0}
    last_chunk = {rid: t for rid, chunk, t in log if chunk == 2}
    third = max(first_chunk, key=first_chunk.__getitem__)  # the one that had to wait
    # It started only once one of the two running streams had finished.
    assert first_chunk[third] >= min(t for rid, t in last_chunk.items() if rid != third)


async def test_an_abort_stops_a_stream_mid_way(make_client: MakeClient) -> None:
    config = stage_config(0, output_bytes=20 * 65536, output_chunks=20, step_latency_ms=50)
    client = await make_client(config, stage_id=0, async_chunk=True)
    stream = client.stream(whole_input("gone"))
    seen = [await anext(stream), await anext(stream)]
    assert [o.chunk for o in seen] == [0, 1]
    await stream.aclose()  # leaving early: Abort + Release go to the engine
    await asyncio.sleep(1.2)  # stats arrive every 0.5 s
    steps = client.stats.steps
    assert client.stats.running == 0 and steps < 10
    await asyncio.sleep(0.6)
    assert client.stats.steps == steps  # the stream no longer advances
    assert shm_files(client.engine_prefix) != set()  # pooled for reuse, not leaked
    outs = await collect(client, whole_input("after"))
    assert len(outs) == 20 and outs[-1].last
    client.release("after")


async def test_stop_drains_running_streams(make_client: MakeClient) -> None:
    config = stage_config(0, output_bytes=64, output_chunks=5, step_latency_ms=50)
    client = await make_client(config, stage_id=0, async_chunk=True)
    stream = client.stream(whole_input("drained"))
    outs = [await anext(stream)]
    stopping = asyncio.create_task(client.stop(timeout_s=10))
    outs += [out async for out in stream]
    await stopping
    assert [o.chunk for o in outs] == [0, 1, 2, 3, 4] and outs[-1].last
    assert all(o.error is None for o in outs)
    assert client.deaths == []


async def test_work_is_keyed_by_chunk_and_an_abort_holds_its_key_until_answered(
    make_client: MakeClient,
) -> None:
    """Two chunks of one request run side by side; the same chunk twice is refused; work left
    early keeps its key (and its input slot) until the engine's "aborted" answer is back."""
    config = stage_config(1, output_bytes=64, step_latency_ms=300)
    client = await make_client(config, stage_id=1, async_chunk=True)
    big = Payload(tensors={"hidden": tensor_from_array(np.zeros(2 * MiB, dtype=np.uint8))})

    def chunk(c: int) -> StageInput:
        si = whole_input("req")
        return StageInput(
            pipeline="synthetic",
            request_id="req",
            stage_id=1,
            from_stage=0,
            chunk=c,
            last=False,
            deadline_ms=si.deadline_ms,
            seed=1,
            payload=big,
        )

    first, second = await asyncio.gather(collect(client, chunk(0)), collect(client, chunk(1)))
    assert [(o.chunk, o.last) for o in first + second] == [(0, False), (1, False)]
    client.release(transfer_key(chunk(0)))
    client.release(transfer_key(chunk(1)))

    stream = client.stream(chunk(2))
    task = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.1)  # submitted, the engine is in its 300 ms step
    with pytest.raises(EngineBusyError, match="already running"):
        await anext(client.stream(chunk(2)))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    key = transfer_key(chunk(2))
    assert client.is_running(key)  # aborting: a resubmission now would be refused
    assert client.arena.stats().slots_in_use == 1  # the engine may still read the input
    for _ in range(100):
        if not client.is_running(key):
            break
        await asyncio.sleep(0.02)
    assert not client.is_running(key) and client.arena.stats().slots_in_use == 0
