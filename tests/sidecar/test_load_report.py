"""What a pod's heartbeats report (``sidecar/admission/load_report.py``): a vLLM engine's own
counts, every engine's work averaged since the previous heartbeat (``occupancy``) and the
requests' queue wait (``queue_wait_ms``) in a form a control plane that predates them takes,
an API server's first audio over its last seconds (``first_audio_le_<s>``), and a split
stage's prefill replica's work seen over the heartbeat interval, which vLLM's
counts, read between steps, never show (the prefill pool autoscaling end to end:
tests/engines/vllm/test_vllm_pd_autoscale.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field

from omni_mesh.control_plane.autoscaling.audio_slo import first_audio_p95
from omni_mesh.control_plane.client import (
    ENGINE_FIRST_AUDIO_COUNT,
    ENGINE_OCCUPANCY,
    ENGINE_QUEUE_WAIT_MS,
    InstanceInfo,
    InstanceState,
)
from omni_mesh.data_plane.messages import EngineStats, Stats
from omni_mesh.observability.audio_slo import AudioPlayback
from omni_mesh.observability.metrics import SidecarMetrics
from omni_mesh.sidecar.admission.gate import AdmissionGate
from omni_mesh.sidecar.admission.load_report import load_report
from omni_mesh.sidecar.admission.queue import AdmissionQueue, Waiter
from omni_mesh.sidecar.hop.prefill_tokens import PREFILL_TOKENS_QUEUED

pytestmark = pytest.mark.unit


@dataclass
class FakeEngine:
    """The engine client's figures (the far side: its own averaging is
    tests/sidecar/test_engine_occupancy.py)."""

    stats: Stats
    in_flight: int = 0
    means: list[float] = field(default_factory=list)  # what each mean_in_flight() returns
    queue_waits_ms: list[float] = field(default_factory=list)  # each mean_queue_wait_ms()'s

    def mean_in_flight(self) -> float:
        return self.means.pop(0) if self.means else 0.0

    def mean_queue_wait_ms(self) -> float:
        return self.queue_waits_ms.pop(0) if self.queue_waits_ms else 0.0


@dataclass
class FakeStageConfig:
    prefill: object | None = None  # a split stage's prefill: block
    max_num_seqs: int = 16
    max_inflight: int = 64


@dataclass
class FakeSettings:
    role: str = "both"


@dataclass
class FakePod:
    """The attributes of :class:`~omni_mesh.sidecar.pod.Pod` that the load report reads."""

    engine: FakeEngine | None
    settings: FakeSettings = field(default_factory=FakeSettings)
    stage_config: FakeStageConfig = field(default_factory=FakeStageConfig)
    gate: AdmissionGate = field(
        default_factory=lambda: AdmissionGate(
            AdmissionQueue(64, 16, 30.0), SidecarMetrics(CollectorRegistry()), ("p", "0")
        )
    )
    in_flight: int = 0
    serves_api: bool = False
    metrics: SidecarMetrics = field(default_factory=lambda: SidecarMetrics(CollectorRegistry()))


def vllm_between_steps() -> FakeEngine:
    """A vLLM engine's report read between two steps: nothing running, nothing waiting."""
    engine = EngineStats(running=0, waiting=0, kv_cache_usage=0.01, tokens_per_s=0.0)
    stats = Stats(queued=0, running=0, batch_size=2, step_ms=4.0, steps=100, engine=engine)
    return FakeEngine(stats)


def held_for(pod: FakePod, ago_s: tuple[float, float], slots: int) -> None:
    """``slots`` pieces of work that held a slot from ``ago_s[0]`` to ``ago_s[1]`` s ago."""
    queue, now = pod.gate.queue, time.monotonic()
    for _ in range(slots):
        queue.offer(Waiter(1, "", now + 60, now - ago_s[0]), now - ago_s[0])  # type: ignore[arg-type]
    for _ in range(slots):
        queue.release(now - ago_s[1], ago_s[0] - ago_s[1])


def test_a_prefill_replica_reports_the_slots_its_work_held_since_the_last_heartbeat() -> None:
    pod = FakePod(vllm_between_steps(), FakeSettings("prefill"), FakeStageConfig(prefill={}))
    held_for(pod, (1.0, 0.5), slots=2)  # two prefills, answered before this heartbeat
    report = load_report(pod)  # type: ignore[arg-type]
    assert report.in_flight == 0 and report.engine["waiting"] == 0.0
    assert report.engine["running"] == pytest.approx(1.0, rel=0.1)  # 2 slots x 0.5 of 1 s
    assert report.engine[ENGINE_OCCUPANCY] == pytest.approx(1.0, rel=0.1)  # the same, averaged
    assert report.engine[PREFILL_TOKENS_QUEUED] == 0.0
    # The next heartbeat covers only the time since this one: idle.
    again = load_report(pod)  # type: ignore[arg-type]
    assert again.engine["running"] == 0.0 and again.engine[ENGINE_OCCUPANCY] == 0.0


def test_other_replicas_report_their_engines_own_counts() -> None:
    # A decode replica's (and an unsplit stage's) work in flight may wait on later stages:
    # vLLM's scheduler says what is the engine's own.
    for settings, config in (
        (FakeSettings("decode"), FakeStageConfig(prefill={})),
        (FakeSettings("both"), FakeStageConfig()),
    ):
        pod = FakePod(vllm_between_steps(), settings, config)
        held_for(pod, (1.0, 0.5), slots=2)
        report = load_report(pod)  # type: ignore[arg-type]
        assert report.engine["running"] == 0.0
        assert (PREFILL_TOKENS_QUEUED in report.engine) == (config.prefill is not None)
    # An engine without a scheduler of its own: work handed to it less its queue.
    engine = FakeEngine(Stats(queued=1, running=0, batch_size=1, step_ms=1.0, steps=1), 3)
    report = load_report(FakePod(engine))  # type: ignore[arg-type]
    assert report.engine["running"] == 2.0 and report.queued == 1
    assert load_report(FakePod(None)).engine == {}  # type: ignore[arg-type]


class LoadReportBefore(BaseModel):
    """``LoadReport`` as a control plane that predates ``occupancy`` reads it: strict, unknown
    fields refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    in_flight: int = Field(default=0, ge=0)
    queued: int = Field(default=0, ge=0)
    capacity: int = Field(default=0, ge=0)
    engine: dict[str, float] = Field(default_factory=dict, max_length=64)


def test_every_engine_reports_its_work_averaged_since_the_last_heartbeat() -> None:
    # Read at this instant nothing runs; over the interval the engine held 0.04 on average.
    engine = FakeEngine(Stats(queued=0, running=0, batch_size=1, step_ms=40.0, steps=9), 0, [0.04])
    report = load_report(FakePod(engine))  # type: ignore[arg-type]
    assert report.engine["running"] == 0.0
    assert report.engine[ENGINE_OCCUPANCY] == 0.04
    # vLLM's engine too (its scheduler's counts are instant as well).
    vllm = vllm_between_steps()
    vllm.means = [2.5]
    assert load_report(FakePod(vllm)).engine[ENGINE_OCCUPANCY] == 2.5  # type: ignore[arg-type]
    # A control plane that predates the figure takes the heartbeat: it is an engine figure,
    # not a field of its own (a rolling upgrade runs new pods against an old control plane).
    body = report.model_dump_json()
    assert LoadReportBefore.model_validate_json(body).engine[ENGINE_OCCUPANCY] == 0.04


def test_the_queue_wait_adds_the_admission_queue_and_the_engines() -> None:
    engine = FakeEngine(Stats(queued=0, running=1, batch_size=1, step_ms=40.0, steps=9), 1)
    engine.queue_waits_ms = [30.0, 0.0]  # the engine's queue: 30 ms, then none started
    pod = FakePod(engine, gate=AdmissionGate(
        AdmissionQueue(1, 16, 30.0), SidecarMetrics(CollectorRegistry()), ("p", "0")
    ))  # fmt: skip
    queue, now = pod.gate.queue, time.monotonic()
    queue.offer(Waiter(1, "", now + 60, now - 1.0), now - 1.0)  # type: ignore[arg-type]
    queue.offer(Waiter(1, "", now + 60, now - 0.9), now - 0.9)  # type: ignore[arg-type]
    queue.release(now - 0.5, 0.5)  # the second waited 0.4 s for the first's slot
    report = load_report(pod)  # type: ignore[arg-type]
    assert report.engine[ENGINE_QUEUE_WAIT_MS] == pytest.approx(400.0 / 2 + 30.0, abs=1.0)
    # Nobody admitted or started since, nobody waits: no wait.
    assert load_report(pod).engine[ENGINE_QUEUE_WAIT_MS] == 0.0  # type: ignore[arg-type]


def test_an_api_server_reports_its_first_audio_window_in_a_form_older_control_planes_take() -> None:
    api_only = FakePod(None, serves_api=True)
    assert load_report(api_only).engine == {}  # type: ignore[arg-type]  # no answer yet: none
    for i in range(30):  # 30 answers, their first audio 10..300 ms after their request
        # (times from 0: differences of monotonic readings put 0.3 s a rounding above 0.3)
        playback = AudioPlayback(started=0.0)
        playback.sent(0.08, (i + 1) / 100)
        api_only.metrics.audio.record(playback, "tiny-tts", "/v1/audio/speech", "")
    first = load_report(api_only)  # type: ignore[arg-type]
    assert first.engine[ENGINE_FIRST_AUDIO_COUNT] == 30.0
    assert first.engine["first_audio_le_0.1"] == 10.0 and first.engine["first_audio_le_0.3"] == 30
    # Their real-time factor the same way (0.08 s of audio over 0.01..0.3 s: 23 at most 1x).
    assert first.engine["rtf_count"] == 30.0 and first.engine["rtf_le_1"] == 23.0
    # A snapshot of the window, not a change since the last heartbeat: the next says the same.
    assert load_report(api_only).engine == first.engine  # type: ignore[arg-type]
    # What the autoscaler reads from it: the p95 lies in (0.2, 0.3].
    info = InstanceInfo(
        instance_id="a", pipeline="tiny-tts", stage_id=0, address="http://127.0.0.1:1",
        host_id="h", capacity=1, state=InstanceState.HEALTHY, epoch=1, registered_at_ms=0,
        last_heartbeat_ms=0, heartbeat_age_ms=0, load=first,
    )  # fmt: skip
    p95_ms, samples = first_audio_p95([info])
    assert samples == 30 and p95_ms is not None and 200.0 < p95_ms <= 300.0
    # Free-form engine figures: a control plane that predates them takes the heartbeat.
    assert len(first.engine) <= 64
    before = LoadReportBefore.model_validate_json(first.model_dump_json())
    assert before.engine[ENGINE_FIRST_AUDIO_COUNT] == 30.0
    # A pod that does not serve the API (headless) reports none, whatever it holds.
    headless = FakePod(None, metrics=api_only.metrics)
    assert ENGINE_FIRST_AUDIO_COUNT not in load_report(headless).engine  # type: ignore[arg-type]
