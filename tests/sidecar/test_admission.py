"""Admission in-process: draining → 503, duplicate → 409, full → the admission queue (waits,
is admitted when a slot frees, shed with 503 + Retry-After), and a client request's class."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry, Gauge

from omni_mesh.configs.deploy import DeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import StageInput
from omni_mesh.observability.metrics import (
    SC_IN_FLIGHT,
    SC_QUEUE_LENGTH,
    SC_REJECTED,
    SC_SHED,
    SidecarMetrics,
)
from omni_mesh.sidecar.admission import facts
from omni_mesh.sidecar.admission.admit import admitted, api_slots
from omni_mesh.sidecar.admission.early_shed import EarlyShed
from omni_mesh.sidecar.admission.facts import admission_facts, request_class
from omni_mesh.sidecar.admission.gate import AdmissionGate
from omni_mesh.sidecar.errors import ApiError

pytestmark = pytest.mark.unit


@dataclass
class FakeEngine:
    running: set[str] = field(default_factory=set)

    def is_running(self, request_id: str) -> bool:
        return request_id in self.running


@dataclass
class FakeStageConfig:
    max_inflight: int = 2
    max_queue: int = 4
    max_queue_wait_s: float = 30.0


@dataclass
class FakeSettings:
    api_max_inflight: int | None = 3


@dataclass
class FakePod:
    """The attributes of :class:`~omni_mesh.sidecar.pod.Pod` that admission reads."""

    metrics: SidecarMetrics
    pipeline: object = field(default_factory=lambda: get_pipeline("synthetic"))
    stage_id: int = 1
    stage_config: FakeStageConfig = field(default_factory=FakeStageConfig)
    engine: FakeEngine | None = field(default_factory=FakeEngine)
    draining: bool = False
    in_flight: int = 0
    admitted: int = 0
    gate: AdmissionGate | None = None
    settings: FakeSettings = field(default_factory=lambda: FakeSettings())
    deploy: DeployConfig = field(default_factory=DeployConfig)

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(
            name, {"pipeline": "synthetic", "stage": "1", **labels}
        )
        return 0.0 if value is None else value

    def rejected(self, reason: str) -> float:
        return self.sample(f"{SC_REJECTED}_total", reason=reason)

    @property
    def in_flight_gauge(self) -> Gauge:
        return self.metrics.in_flight.labels("synthetic", "1")

    def request_timeout_s(self) -> float:
        return float(self.deploy.request_timeout_s)


@pytest.fixture
def pod() -> FakePod:
    return FakePod(metrics=SidecarMetrics(CollectorRegistry()))


def stage_input(
    rid: str, priority: str = "normal", tenant: str = "", deadline_s: float = 60
) -> StageInput:
    return StageInput(
        pipeline="synthetic",
        request_id=rid,
        stage_id=1,
        deadline_ms=int((time.time() + deadline_s) * 1000),
        seed=1,
        priority=priority,  # type: ignore[arg-type]
        tenant=tenant,
    )


async def hold(
    pod: FakePod, rid: str, release: asyncio.Event, order: list[str], **kw: object
) -> None:
    async with admitted(pod, rid, "hop", stage_input(rid, **kw)):  # type: ignore[arg-type]
        order.append(rid)
        await release.wait()


async def test_admitted_counts_in_flight_and_releases_on_exit(pod: FakePod) -> None:
    async with admitted(pod, "r1", "hop"):  # type: ignore[arg-type]
        assert pod.in_flight == 1 and pod.sample(SC_IN_FLIGHT) == 1
        async with admitted(pod, "r2", "run"):  # type: ignore[arg-type]
            assert pod.in_flight == 2
    assert pod.in_flight == 0 and pod.sample(SC_IN_FLIGHT) == 0
    assert pod.admitted == 2  # the GC pacer's sign of activity: every admission counts
    with pytest.raises(RuntimeError):
        async with admitted(pod, "r3", "hop"):  # type: ignore[arg-type]
            raise RuntimeError("handler failed")
    assert pod.in_flight == 0 and pod.gate is not None and pod.gate.queue.in_use == 0


async def test_a_draining_pod_answers_503(pod: FakePod) -> None:
    pod.draining = True
    with pytest.raises(ApiError) as info:
        async with admitted(pod, "r", "hop"):  # type: ignore[arg-type]
            pytest.fail("admitted while draining")
    err = info.value
    assert (err.status, err.type, err.headers) == (503, "unavailable", {"Retry-After": "1"})
    assert pod.rejected("draining") == 1


async def test_a_duplicate_request_answers_409(pod: FakePod) -> None:
    assert pod.engine is not None
    pod.engine.running.add("dup")
    with pytest.raises(ApiError) as info:
        async with admitted(pod, "dup", "hop"):  # type: ignore[arg-type]
            pytest.fail("admitted a duplicate")
    assert (info.value.status, info.value.type) == (409, "conflict")
    assert pod.rejected("duplicate") == 1 and pod.in_flight == 0


async def test_a_full_pod_queues_in_priority_order_and_admits_as_slots_free(
    pod: FakePod,
) -> None:
    """Replaces the old "full → 429": the request waits for a slot, no answer until then."""
    release, order = asyncio.Event(), []  # type: ignore[var-annotated]
    tasks = [asyncio.create_task(hold(pod, f"run{i}", release, order)) for i in range(2)]
    await asyncio.sleep(0.01)
    waiting = [
        asyncio.create_task(hold(pod, "low", release, order, priority="low")),
        asyncio.create_task(hold(pod, "normal", release, order)),
        asyncio.create_task(hold(pod, "high", release, order, priority="high")),
    ]
    await asyncio.sleep(0.01)
    assert order == ["run0", "run1"] and pod.in_flight == 2
    assert pod.sample(SC_QUEUE_LENGTH, priority="low") == 1
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks, *waiting), 5)
    assert order[2:] == ["high", "normal", "low"]
    assert pod.in_flight == 0 and pod.sample(SC_QUEUE_LENGTH, priority="low") == 0


async def test_a_full_queue_sheds_with_503_and_retry_after(pod: FakePod) -> None:
    pod.stage_config.max_queue = 0
    release, order = asyncio.Event(), []  # type: ignore[var-annotated]
    tasks = [asyncio.create_task(hold(pod, f"run{i}", release, order)) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError) as info:
        async with admitted(pod, "late", "hop", stage_input("late")):  # type: ignore[arg-type]
            pytest.fail("admitted past the queue")
    err = info.value
    assert (err.status, err.type) == (503, "shed")
    assert err.headers == {"Retry-After": "1", "X-Omni-Shed": "queue_full"}
    assert err.message.startswith("shed (queue_full)")
    assert pod.sample(f"{SC_SHED}_total", reason="queue_full", priority="normal") == 1
    release.set()
    await asyncio.gather(*tasks)


async def test_a_waiter_whose_deadline_passes_is_shed_while_waiting(pod: FakePod) -> None:
    release, order = asyncio.Event(), []  # type: ignore[var-annotated]
    tasks = [asyncio.create_task(hold(pod, f"run{i}", release, order)) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError) as info:
        await asyncio.wait_for(hold(pod, "short", release, order, deadline_s=0.2), 5)
    assert info.value.headers["X-Omni-Shed"] == "deadline"
    assert "short" not in order and pod.gate is not None and len(pod.gate.queue) == 0
    release.set()
    await asyncio.gather(*tasks)


async def test_a_cancelled_waiter_leaves_the_queue(pod: FakePod) -> None:
    release, order = asyncio.Event(), []  # type: ignore[var-annotated]
    tasks = [asyncio.create_task(hold(pod, f"run{i}", release, order)) for i in range(2)]
    await asyncio.sleep(0.01)
    gone = asyncio.create_task(hold(pod, "gone", release, order))
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert pod.gate is not None and len(pod.gate.queue) == 0
    release.set()
    await asyncio.gather(*tasks)
    assert "gone" not in order and pod.gate.queue.in_use == 0


async def test_an_api_only_pod_uses_api_max_inflight(pod: FakePod) -> None:
    pod.engine = None
    release, order = asyncio.Event(), []  # type: ignore[var-annotated]
    tasks = [asyncio.create_task(hold(pod, f"r{i}", release, order)) for i in range(4)]
    await asyncio.sleep(0.01)
    assert len(order) == 3  # api_max_inflight
    release.set()
    await asyncio.gather(*tasks)


def test_an_api_servers_default_slots_follow_the_entry_pool(pod: FakePod) -> None:
    pod.engine = None
    pod.settings.api_max_inflight = None
    assert api_slots(pod) == 128  # type: ignore[arg-type]  # twice the 64 slots of stage 0
    pod.deploy = DeployConfig.model_validate(
        {"stages": [{"stage_id": 0, "max_inflight": 100, "num_replicas": 3}]}
    )
    assert api_slots(pod) == 600  # type: ignore[arg-type]
    pod.deploy = DeployConfig.model_validate({"stages": [{"stage_id": 0, "max_inflight": 4}]})
    assert api_slots(pod) == 64  # type: ignore[arg-type]  # at least


# ---- a client request's class ----------------------------------------------------------------


def test_request_class_from_headers_and_body(pod: FakePod) -> None:
    req = make_mocked_request("POST", "/v1/generate", headers={"X-Omni-Priority": "High"})
    assert request_class(pod, req) == ("high", "")  # type: ignore[arg-type]
    assert request_class(pod, req, "low") == ("high", "")  # type: ignore[arg-type]  # header wins
    req = make_mocked_request("POST", "/v1/generate")
    assert request_class(pod, req, "low") == ("low", "")  # type: ignore[arg-type]
    req = make_mocked_request("POST", "/v1/generate", headers={"X-Omni-Tenant": "team-a"})
    assert request_class(pod, req) == ("normal", "team-a")  # type: ignore[arg-type]
    req = make_mocked_request("POST", "/v1/generate", headers={"Authorization": "Bearer sk-1"})
    _, tenant = request_class(pod, req)  # type: ignore[arg-type]
    assert tenant.startswith("key-") and "sk-1" not in tenant


@pytest.mark.parametrize(
    ("headers", "param"),
    [
        ({"X-Omni-Priority": "urgent"}, "X-Omni-Priority"),
        ({"X-Omni-Tenant": "a b"}, "X-Omni-Tenant"),
    ],
)
def test_a_bad_class_is_a_400_naming_it(pod: FakePod, headers: dict[str, str], param: str) -> None:
    req = make_mocked_request("POST", "/v1/generate", headers=headers)
    with pytest.raises(ApiError) as info:
        request_class(pod, req)  # type: ignore[arg-type]
    assert (info.value.status, info.value.param) == (400, param)


def test_a_route_may_cap_its_classes(pod: FakePod) -> None:
    pod.deploy = DeployConfig.model_validate({"priority_classes": {"/v1/generate": ["low"]}})
    req = make_mocked_request("POST", "/v1/generate", headers={"X-Omni-Priority": "high"})
    with pytest.raises(ApiError, match="accepted: low") as info:
        request_class(pod, req)  # type: ignore[arg-type]
    assert info.value.param == "priority"
    req = make_mocked_request("POST", "/v1/generate", headers={"X-Omni-Priority": "low"})
    assert request_class(pod, req)[0] == "low"  # type: ignore[arg-type]


async def test_a_requests_headers_are_read_once_on_its_way_in(
    pod: FakePod, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shed check (under load) and the entry step share one read of the headers."""
    reads: list[object] = []
    read = facts._read
    monkeypatch.setattr(facts, "_read", lambda p, r: reads.append(r) or read(p, r))
    pod.engine = None  # an API server: three slots
    async with admitted(pod, "a", "api"), admitted(pod, "b", "api"), admitted(pod, "c", "api"):
        headers = {"X-Omni-Priority": "low", "X-Omni-Tenant": "t1", "X-Omni-Timeout-S": "9"}
        req = make_mocked_request("POST", "/v1/audio/speech", headers=headers)
        assert EarlyShed(pod).check(req, "/v1/audio/speech") is None  # type: ignore[arg-type]
        assert len(reads) == 1  # the gate is busy: the check read the headers
        assert request_class(pod, req, "high") == ("low", "t1")  # type: ignore[arg-type]
        got = admission_facts(pod, req)  # type: ignore[arg-type]
        assert (got.tenant, got.timeout_s) == ("t1", 9.0)
        assert reads == [req]


def test_a_malformed_timeout_is_the_routes_400(pod: FakePod) -> None:
    req = make_mocked_request("POST", "/v1/generate", headers={"X-Omni-Timeout-S": "soon"})
    got = admission_facts(pod, req)  # type: ignore[arg-type]
    assert got.malformed
    raised = []
    for _ in range(2):  # a new error each time (a realtime session resolves once per response)
        with pytest.raises(ApiError) as info:
            got.resolve(pod, "/v1/generate", None)  # type: ignore[arg-type]
        assert (info.value.status, info.value.param) == (400, "X-Omni-Timeout-S")
        assert info.value.message == "X-Omni-Timeout-S: not a number"
        raised.append(info.value)
    assert raised[0] is not raised[1]
