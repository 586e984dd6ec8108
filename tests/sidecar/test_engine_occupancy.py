"""The engine's work in flight averaged over time (``EngineClient.mean_in_flight``, reported in
heartbeats as ``occupancy``), against a real synthetic engine process: short requests leave no
trace in the count read at one instant between them, and their time in the average; each
reading covers the time since the one before. And the mean wait in the engine's queue of the
requests it started since the last reading (``mean_queue_wait_ms``, part of ``queue_wait_ms``).

The bounds hold on a machine of any speed: the engine holds a request at least its step
latency (40 ms), and the sidecar no longer than the test waited for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Payload, StageInput, transfer_key
from omni_mesh.sidecar.engine_link.client import EngineClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STEP_S = 0.040


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[EngineClient]:
    base = load_deploy_config(None, get_pipeline("synthetic")).stage(1)
    config = base.model_copy(update={"step_latency_ms": STEP_S * 1000, "max_num_seqs": 1})
    client = EngineClient("synthetic", 1, config, log_level="WARNING")
    await client.start(timeout_s=60)
    try:
        yield client
    finally:
        await client.stop()


def _si(rid: str) -> StageInput:
    return StageInput(
        pipeline="synthetic",
        request_id=rid,
        stage_id=1,
        deadline_ms=int(time.time() * 1000) + 60_000,
        seed=1,
        payload=Payload(fields={"prompt": "x"}),
    )


async def _run(engine: EngineClient, rid: str) -> float:
    """One request to its last output; the seconds the test waited for it."""
    si = _si(rid)
    t0 = time.monotonic()
    async for out in engine.stream(si):
        assert out.error is None, out.error
    waited = time.monotonic() - t0
    engine.release(transfer_key(si))
    return waited


async def test_short_requests_show_in_the_average_not_in_the_instant(
    engine: EngineClient,
) -> None:
    engine.mean_in_flight()  # the start-up's interval ends here
    await asyncio.sleep(0.3)
    assert engine.mean_in_flight() == 0.0  # idle since the last reading
    t0 = time.monotonic()
    waited = 0.0
    for k in range(3):  # three 40 ms requests, 150 ms apart
        waited += await _run(engine, f"r{k}")
        assert engine.in_flight == 0  # what a reading at one instant between them says
        await asyncio.sleep(0.15)
    mean = engine.mean_in_flight()
    span = time.monotonic() - t0
    assert 3 * STEP_S / span <= mean <= waited / span, (mean, waited, span)
    # The next reading covers only the time since this one: idle again.
    await asyncio.sleep(0.1)
    assert engine.mean_in_flight() == 0.0


async def test_a_queue_counts_in_the_average(engine: EngineClient) -> None:
    # Two at once on max_num_seqs 1: the second waits a step in the engine's queue, and the
    # average counts it waiting as well as running (as the policy's demand does).
    engine.mean_in_flight()
    t0 = time.monotonic()
    waits = await asyncio.gather(_run(engine, "a"), _run(engine, "b"))
    mean = engine.mean_in_flight()
    span = time.monotonic() - t0
    assert 3 * STEP_S / span <= mean <= sum(waits) / span, (mean, waits, span)


async def test_the_engine_queue_wait_is_the_mean_of_the_requests_started(
    engine: EngineClient,
) -> None:
    await _run(engine, "warm")
    assert 0.0 <= engine.mean_queue_wait_ms() < STEP_S * 1000  # alone: it waited for nothing
    # Three at once on max_num_seqs 1: whichever the engine reads together, the last of them
    # waits a whole step behind another (the engine dates a request when it reads it).
    waits = await asyncio.gather(*(_run(engine, f"q{k}") for k in range(3)))
    mean_ms = engine.mean_queue_wait_ms()
    assert STEP_S * 1000 / 3 <= mean_ms <= max(waits) * 1000, (mean_ms, waits)
    assert engine.mean_queue_wait_ms() == 0.0  # none started since
