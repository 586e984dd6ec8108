"""The engine process through :class:`EngineClient`, with no HTTP: handshake, shared-memory
tensors both ways, batching, abort, release, engine death, drain and ``/dev/shm`` hygiene.

Every test starts a real ``python -m omni_mesh.engines`` child running the synthetic stage 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Payload, StageInput
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.synthetic import synthetic_bytes
from omni_mesh.sidecar.engine_link.client import EngineDeadError, EngineStartError
from tests.engines.process_helpers import MakeClient, MiB, execute, shm_files, stage_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SYN = "omni_mesh.engines.synthetic:SyntheticEngine"
SALT = "synthetic/1"


def stage1_config(**update: Any) -> StageDeployConfig:
    return stage_config(1, **update)


def big_tensor_payload(nbytes: int = 2 * MiB) -> Payload:
    arr = (np.arange(nbytes) % 251).astype(np.uint8)
    return Payload(fields={"prompt": "p"}, tensors={"hidden": tensor_from_array(arr)})


def stage_input(
    request_id: str,
    *,
    seed: int = 1,
    payload: Payload | None = None,
    deadline_ms: int | None = None,
) -> StageInput:
    return StageInput(
        pipeline="synthetic",
        request_id=request_id,
        stage_id=1,
        from_stage=0,
        deadline_ms=deadline_ms or int((time.time() + 60) * 1000),
        seed=seed,
        payload=payload or Payload(fields={"prompt": "p"}),
    )


def block_event_loop(seconds: float) -> None:
    """Hold the event loop (deliberately): whatever the engine sends meanwhile waits unread."""
    time.sleep(seconds)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


# ---- start, execute, release -----------------------------------------------------------------


async def test_start_reports_ready_with_what_the_sidecar_needs(make_client: MakeClient) -> None:
    client = await make_client(stage1_config(max_num_seqs=5))
    assert client.ready is not None
    assert (client.ready.engine, client.ready.max_num_seqs) == (SYN, 5)
    assert client.ready.load_seconds >= 0.0
    assert client.engine_pid is not None and pid_alive(client.engine_pid)
    assert client.engine_prefix is not None
    assert client.engine_prefix.startswith(f"omni-{client.engine_pid}-")
    assert not client.dead.is_set()


def mapped_files(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


async def test_a_synthetic_engine_process_never_loads_torch(make_client: MakeClient) -> None:
    """The synthetic engine is numpy only: its process maps no torch library (an idle one was
    ~230 MB with torch); a reference-model engine does load it."""
    synthetic = await make_client()
    assert synthetic.engine_pid is not None
    assert "torch" not in mapped_files(synthetic.engine_pid)
    reference = await make_client(StageDeployConfig(stage_id=1), pipeline="tiny-tts")
    assert reference.engine_pid is not None
    assert "libtorch" in mapped_files(reference.engine_pid)


async def test_execute_moves_tensors_through_shared_memory(make_client: MakeClient) -> None:
    client = await make_client()
    si = stage_input("big-1", seed=42, payload=big_tensor_payload())
    out = await execute(client, si)
    try:
        assert out.error is None, out.error
        assert (out.request_id, out.stage_id) == ("big-1", 1)
        # The 2 MiB input went through the sidecar's arena, and its slot is free again.
        stats = client.arena.stats()
        assert stats.allocs == 1 and stats.slots_in_use == 0
        assert stats.bytes_pooled >= 2 * MiB
        (nxt,) = out.next
        assert (nxt.stage_id, nxt.from_stage, nxt.request_id, nxt.seed) == (2, 1, "big-1", 42)
        assert nxt.payload.fields == {"prompt": "p"}
        tensor = nxt.payload.tensors["data"]
        assert tensor.data is None and tensor.shm is not None  # a handle, not the bytes
        assert tensor.shm.segment.startswith(f"{client.engine_prefix}-")
        data = array_from_tensor(tensor, client.reader)
        assert data.tobytes() == synthetic_bytes(42, SALT, MiB).tobytes()
        assert not client.is_running("big-1") and client.in_flight == 0
    finally:
        client.release("big-1")


async def test_small_outputs_come_back_inline(make_client: MakeClient) -> None:
    client = await make_client(stage1_config(output_bytes=100))
    out = await execute(client, stage_input("small", seed=3))
    tensor = out.next[0].payload.tensors["data"]
    assert tensor.shm is None and tensor.data is not None
    assert array_from_tensor(tensor).tobytes() == synthetic_bytes(3, SALT, 100).tobytes()
    assert client.arena.stats().allocs == 0  # nothing big to send: no slot either
    client.release("small")


async def test_release_lets_the_engine_reuse_its_output_slot(make_client: MakeClient) -> None:
    client = await make_client()

    async def output_segment(rid: str) -> str:
        out = await execute(client, stage_input(rid))
        ref = out.next[0].payload.tensors["data"].shm
        assert ref is not None
        return ref.segment

    first = await output_segment("a")
    second = await output_segment("b")  # "a" is not released: its slot stays taken
    assert second != first
    client.release("a")
    client.release("b")
    await asyncio.sleep(0.2)  # Release is fire-and-forget
    reused = {await output_segment("c"), await output_segment("d")}
    assert reused == {first, second}
    assert shm_files(client.engine_prefix) == {first, second}
    client.release("c")
    client.release("d")


async def test_concurrent_requests_are_batched(make_client: MakeClient) -> None:
    client = await make_client(stage1_config(max_num_seqs=8, step_latency_ms=50, output_bytes=64))
    seen: list[int] = []

    async def sample_stats() -> None:
        while True:
            seen.append(client.stats.batch_size)
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample_stats())
    try:
        outs = await asyncio.gather(
            *(execute(client, stage_input(f"r{i}", seed=i)) for i in range(16))
        )
    finally:
        sampler.cancel()
    for i, out in enumerate(outs):
        assert out.request_id == f"r{i}" and out.error is None
        data = array_from_tensor(out.next[0].payload.tensors["data"])
        assert data.tobytes() == synthetic_bytes(i, SALT, 64).tobytes()
        client.release(out.request_id)
    await wait_until(lambda: client.stats.steps >= 2)
    assert 1 < max(seen) <= 8
    assert client.stats.steps < 16  # fewer steps than requests


# ---- abort -----------------------------------------------------------------------------------


async def test_cancelled_execute_aborts_in_the_engine_and_frees_slots(
    make_client: MakeClient,
) -> None:
    client = await make_client(stage1_config(step_latency_ms=300))
    task = asyncio.create_task(execute(client, stage_input("gone", payload=big_tensor_payload())))
    await asyncio.sleep(0.1)  # submitted: the engine is executing it
    assert client.is_running("gone")
    assert client.arena.stats().slots_in_use == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.in_flight == 0
    # Our input slot stays ours while the engine may still read it (it is mid-step) and is
    # freed when the engine's last Result for the work (its answer or "aborted") comes back;
    # until then the key counts as running (a resubmission would be refused).
    assert client.arena.stats().slots_in_use == 1 and client.is_running("gone")
    for _ in range(100):
        if client.arena.stats().slots_in_use == 0:
            break
        await asyncio.sleep(0.02)
    assert client.arena.stats().slots_in_use == 0 and not client.is_running("gone")
    await asyncio.sleep(0.2)  # the engine has finished the step and dropped the output
    out = await execute(client, stage_input("next"))
    assert out.error is None
    ref = out.next[0].payload.tensors["data"].shm
    assert ref is not None
    # The aborted request's output slot was freed and reused: the engine holds one segment.
    assert shm_files(client.engine_prefix) == {ref.segment}
    client.release("next")


async def test_cancelled_while_queued_is_never_executed(make_client: MakeClient) -> None:
    client = await make_client(stage1_config(max_num_seqs=1, step_latency_ms=300))
    first = asyncio.create_task(execute(client, stage_input("first")))
    await asyncio.sleep(0.1)
    queued = asyncio.create_task(execute(client, stage_input("queued")))
    await asyncio.sleep(0.05)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    out = await first
    assert out.error is None
    await asyncio.sleep(0.2)
    assert client.stats.steps == 1  # the queued request never reached the engine
    assert len(shm_files(client.engine_prefix)) == 1
    client.release("first")


async def test_a_late_abort_does_not_swallow_a_resubmission(make_client: MakeClient) -> None:
    client = await make_client(stage1_config(step_latency_ms=200, output_bytes=64))
    si = stage_input("again")
    task = asyncio.create_task(execute(client, si))
    await asyncio.sleep(0.05)  # submitted; the engine is executing it
    block_event_loop(1.0)  # the engine sends its Result; we have not read it yet
    task.cancel()  # the client gives up: an Abort goes out after the Result
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.2)
    out = await asyncio.wait_for(execute(client, si), 3.0)  # e.g. a /v1/run retry
    assert out.error is None


async def test_an_expired_request_is_answered_with_a_deadline_error(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    expired = stage_input("late", deadline_ms=int(time.time() * 1000) - 1000)
    out = await asyncio.wait_for(execute(client, expired), 3.0)
    assert out.error is not None and out.error.code == "deadline"


# ---- engine death ----------------------------------------------------------------------------


async def test_kill_9_fails_every_pending_request_at_once(make_client: MakeClient) -> None:
    client = await make_client(stage1_config(step_latency_ms=500))
    held = await execute(client, stage_input("held"))  # not released: an engine slot in use
    assert held.error is None
    pending = [
        asyncio.create_task(execute(client, stage_input(f"p{i}", payload=big_tensor_payload())))
        for i in range(4)
    ]
    await asyncio.sleep(0.1)
    assert client.in_flight == 4
    sidecar_prefix, engine_prefix = client.arena.prefix, client.engine_prefix
    assert shm_files(sidecar_prefix) and shm_files(engine_prefix)
    assert client.engine_pid is not None
    killed_at = time.monotonic()
    os.kill(client.engine_pid, signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 1.0)
    assert time.monotonic() - killed_at < 1.0
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert client.dead.is_set()
    assert len(client.deaths) == 1
    assert "exited" in client.deaths[0] or "closed" in client.deaths[0]
    assert client.in_flight == 0
    assert not shm_files(sidecar_prefix) and not shm_files(engine_prefix)
    with pytest.raises(EngineDeadError):
        await execute(client, stage_input("after"))


# ---- stop ------------------------------------------------------------------------------------


async def test_stop_drains_work_in_flight(make_client: MakeClient) -> None:
    client = await make_client(stage1_config(max_num_seqs=1, step_latency_ms=300))
    running = asyncio.create_task(execute(client, stage_input("running", seed=1)))
    await asyncio.sleep(0.1)
    queued = asyncio.create_task(execute(client, stage_input("queued", seed=2)))
    await asyncio.sleep(0.05)
    stopping = asyncio.create_task(client.stop(timeout_s=10))
    outs = await asyncio.gather(running, queued)
    assert [o.error for o in outs] == [None, None]
    assert [o.request_id for o in outs] == ["running", "queued"]
    await stopping
    assert client.engine_pid is not None and not pid_alive(client.engine_pid)
    assert client.deaths == []


async def test_stop_leaves_no_shared_memory(make_client: MakeClient) -> None:
    client = await make_client()
    out = await execute(client, stage_input("x", payload=big_tensor_payload()))
    assert out.error is None
    client.release("x")
    sidecar_prefix, engine_prefix = client.arena.prefix, client.engine_prefix
    assert shm_files(sidecar_prefix) and shm_files(engine_prefix)  # pooled for reuse
    await client.stop()
    assert not shm_files(sidecar_prefix) and not shm_files(engine_prefix)
    assert client.engine_pid is not None
    assert not shm_files(f"omni-{client.engine_pid}")


async def test_execute_after_stop_raises_engine_dead_error(make_client: MakeClient) -> None:
    client = await make_client()
    await client.stop()
    with pytest.raises(EngineDeadError):
        await execute(client, stage_input("after-stop"))


# ---- failed starts ---------------------------------------------------------------------------


async def test_start_fails_when_the_engine_cannot_load(make_client: MakeClient) -> None:
    tts = get_pipeline("tiny-tts")
    config = load_deploy_config(None, tts).stage(1)
    config = config.model_copy(update={"engine_extras": {"max_frames": 0}})
    client = await make_client(config, pipeline="tiny-tts", stage_id=1, start=False)
    with pytest.raises(EngineStartError, match=r"stage 1: engine failed: .*max_frames"):
        await client.start(timeout_s=30)
    assert client.engine_pid is not None
    await wait_until(lambda: not pid_alive(client.engine_pid or 0))
    assert not shm_files(client.arena.prefix) and not shm_files(f"omni-{client.engine_pid}")
    assert client.deaths == []


async def test_start_fails_when_the_engine_exits_during_start_up(
    make_client: MakeClient,
) -> None:
    client = await make_client(stage1_config(), pipeline="no-such-pipeline", start=False)
    with pytest.raises(EngineStartError, match="exited during start-up"):
        await client.start(timeout_s=30)
    assert client.engine_pid is not None and not pid_alive(client.engine_pid)
    assert not shm_files(client.arena.prefix)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_a_failed_start_leaves_no_descriptor_open(make_client: MakeClient) -> None:
    client = await make_client(stage1_config(), pipeline="no-such-pipeline", start=False)
    before = open_fds()
    with pytest.raises(EngineStartError):
        await client.start(timeout_s=30)
    await asyncio.sleep(0.05)
    assert open_fds() - before == set()
