"""The pure helpers of the qwen3-omni benchmark: a phase's figures (percentiles, audio seconds
per second, real-time factor), PCM length to seconds, the better monolithic variant, and the
monolithic server's batching (which requests go together, left padding). No server started."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from benchmarks.omni import (
    ENGINE,
    MONO_BATCHED,
    MONO_ONE,
    Answer,
    Phase,
    best_mono,
    engine_cores_cell,
    foreign_cores,
    pcm_seconds,
    stat_cpu_seconds,
)
from benchmarks.omni_mono import Job, left_pad, take_batch, waveforms

pytestmark = pytest.mark.unit


def test_pcm_seconds_is_16_bit_mono_at_24_khz() -> None:
    assert pcm_seconds(48_000) == pytest.approx(1.0)
    assert pcm_seconds(240_810) == pytest.approx(5.016875)
    assert pcm_seconds(32_000, 16_000) == pytest.approx(1.0)


def test_answer_rtf_and_phase_figures() -> None:
    assert Answer(0.1, 1.0, 5.0).rtf == pytest.approx(0.2)
    assert math.isnan(Answer(0.1, 1.0, 0.0).rtf)
    phase = Phase("s", 2, wall_s=2.0)
    phase.answers = [Answer(0.1, 1.0, 5.0), Answer(0.3, 2.0, 5.0), Answer(0.2, 1.5, 5.0)]
    assert phase.first(50) == pytest.approx(0.2)
    assert phase.total(50) == pytest.approx(1.5)
    assert phase.total(100) == pytest.approx(2.0)
    assert phase.audio_per_s == pytest.approx(7.5)  # 15 audio seconds over 2 wall seconds
    assert phase.rtf == pytest.approx(0.3)
    assert phase.audio_s == pytest.approx(5.0)
    assert math.isnan(Phase("empty", 1).audio_per_s)


def test_foreign_cores_is_the_rest_of_the_busy_time_per_second() -> None:
    assert foreign_cores(busy_s=3.0, own_s=1.0, wall_s=2.0) == pytest.approx(1.0)
    assert foreign_cores(busy_s=1.0, own_s=1.5, wall_s=2.0) == 0.0  # never negative
    assert math.isnan(foreign_cores(1.0, 0.0, 0.0))


def test_stat_cpu_seconds_reads_utime_and_stime() -> None:
    # pid (comm with a ") " inside) state ppid ... utime (field 14) stime (field 15)
    line = "42 (python3 (x) y) S 1 42 42 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 9 0 7"
    assert stat_cpu_seconds(line, clock_ticks=100) == pytest.approx(3.0)


def test_engine_processes_are_read_by_stage() -> None:
    line = "/v/bin/python -m omni_mesh.engines --pipeline qwen3-omni --stage-id 12 --channel-fd 13"
    match = ENGINE.search(line)
    assert match is not None and match.group(1) == "12"
    assert ENGINE.search("/v/bin/python -m omni_mesh.sidecar.cli_stage --stage-id 1") is None
    phase = Phase("omni-mesh 1:1:1", 8, stage_cores={0: 0.31, 1: 0.5, 2: 0.694})
    assert engine_cores_cell(phase) == "0.31 / 0.50 / 0.69"
    assert engine_cores_cell(Phase(MONO_ONE, 8)) == "-"


def _phase(system: str, concurrency: int, total: float, wall: float) -> Phase:
    p = Phase(system, concurrency, wall_s=wall)
    p.answers = [Answer(total, total, 5.0)]
    return p


def test_best_mono_picks_by_latency_or_throughput() -> None:
    one1, batch1 = _phase(MONO_ONE, 1, 0.6, 0.6), _phase(MONO_BATCHED, 1, 0.7, 0.7)
    one8, batch8 = _phase(MONO_ONE, 8, 4.0, 2.0), _phase(MONO_BATCHED, 8, 2.0, 1.0)
    other = _phase("omni-mesh 1:2:1", 8, 0.1, 0.1)
    phases = [one1, batch1, one8, batch8, other]
    assert best_mono(phases, 1, key="latency") is one1
    assert best_mono(phases, 8, key="throughput") is batch8
    with pytest.raises(RuntimeError):
        best_mono(phases, 16, key="latency")


def test_take_batch_keeps_order_voice_and_size() -> None:
    loop = asyncio.new_event_loop()
    try:
        jobs = [
            Job(f"t{i}", "ethan" if i != 1 else "chelsie", loop.create_future()) for i in range(5)
        ]
        queue = list(jobs)
        assert take_batch(queue, 3) == [jobs[0], jobs[2], jobs[3]]
        assert queue == [jobs[1], jobs[4]]
        assert take_batch(queue, 1) == [jobs[1]]
        assert take_batch(queue, 8) == [jobs[4]]
        assert take_batch(queue, 8) == []
    finally:
        loop.close()


def test_left_pad_pads_on_the_left_with_a_mask() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids == [[5, 6, 7], [0, 0, 8]]
    assert mask == [[1, 1, 1], [0, 0, 1]]
    assert left_pad([], pad_id=0) == ([], [])


class _FakeTensor:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def detach(self) -> _FakeTensor:
        return self

    def float(self) -> _FakeTensor:
        return self

    def cpu(self) -> _FakeTensor:
        return self

    def numpy(self) -> np.ndarray:
        return self.arr


def test_waveforms_of_one_prompt_and_of_a_batch() -> None:
    (one,) = waveforms(_FakeTensor(np.zeros((1, 1, 4), np.float32)), 1)
    assert one.shape == (4,)
    batch = waveforms(
        [_FakeTensor(np.zeros(3, np.float32)), _FakeTensor(np.ones(3, np.float32))], 2
    )
    assert [w.tolist() for w in batch] == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    with pytest.raises(RuntimeError):
        waveforms([_FakeTensor(np.zeros(3, np.float32))], 2)
