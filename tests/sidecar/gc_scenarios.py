"""Scenarios of the collector's pacer (``sidecar/gc_pacer.py``) on a real collector, each run in
a process of its own by ``tests/sidecar/test_gc_pacer.py`` (``python -m
tests.sidecar.gc_scenarios NAME``): they freeze, unfreeze, re-threshold and hook the
collector, which must not happen to the test session's own process."""

from __future__ import annotations

import asyncio
import gc
import sys
import weakref

from prometheus_client import CollectorRegistry

from omni_mesh.observability.gc_metrics import ProcessGcMetrics
from omni_mesh.sidecar.gc_pacer import AUTOMATIC_FULL_OFF, GcPacer, PacerSettings


class Cycle:
    def __init__(self) -> None:
        self.me = self


class Activity:
    def __init__(self) -> None:
        self.in_flight = 0
        self.admitted = 0

    def __call__(self) -> tuple[int, int]:
        return self.in_flight, self.admitted

    def request(self) -> None:
        self.admitted += 1


def pacer(activity: Activity, **settings: float) -> tuple[GcPacer, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = ProcessGcMetrics(registry)
    return GcPacer(activity, metrics, PacerSettings(**settings)), registry  # type: ignore[arg-type]


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def a_busy_pass_freezes_its_survivors_and_the_next_idle_moment_frees_them() -> None:
    activity = Activity()
    p, metrics = pacer(activity, busy_pass_s=0.001, idle_gap_s=1000.0)
    p.install()
    frozen_at_start = gc.get_freeze_count()
    holder = [Cycle()]
    alive = weakref.ref(holder[0])
    gc.collect(1)  # something in the old generation: a full pass has work
    activity.in_flight = 3
    assert p.tick(now=1e9) == "busy"
    assert gc.get_freeze_count() > frozen_at_start  # the pass's survivors, the cycle among them
    holder.clear()  # the cycle is garbage now, but frozen: no collection sees it
    gc.collect()
    assert alive() is not None
    activity.in_flight = 0
    assert p.tick(now=1e9 + 1) is None  # one quiet tick is not idle yet
    assert p.tick(now=1e9 + 2) == "idle_unfreeze"
    assert alive() is None
    assert sample(metrics, "omni_process_gc_paced_collections_total", reason="busy") == 1
    assert sample(metrics, "omni_process_gc_paced_collections_total", reason="idle_unfreeze") == 1


def no_full_pass_while_work_keeps_coming_before_the_busy_interval() -> None:
    activity = Activity()
    p, _ = pacer(activity, busy_pass_s=60.0, idle_gap_s=0.0)
    p.install()
    assert gc.get_threshold()[2] == AUTOMATIC_FULL_OFF  # CPython's own full passes are off
    t0 = p._last_pass
    for i in range(10):
        gc.collect(1)
        activity.request()  # requests finish between ticks: never in flight at a tick
        assert p.tick(now=t0 + i) is None
    activity.request()
    assert p.tick(now=t0 + 61) == "busy"


def an_idle_pass_waits_for_the_gap_and_for_something_to_collect() -> None:
    activity = Activity()
    p, _ = pacer(activity, idle_gap_s=5.0)
    p.install()
    t0 = p._last_pass
    gc.collect(1)
    assert p.tick(now=t0 + 1) is None  # first tick: the admitted count's baseline
    assert p.tick(now=t0 + 2) is None  # idle, but the last pass was 2 s ago
    assert p.tick(now=t0 + 6) == "idle"
    assert gc.get_count()[2] == 0
    assert p.tick(now=t0 + 20) is None  # nothing reached the old generation since


def a_pod_that_never_idles_unfreezes_at_the_cap() -> None:
    activity = Activity()
    activity.in_flight = 1
    p, metrics = pacer(activity, busy_pass_s=0.001, frozen_cap=1)
    p.install()
    keep = [Cycle() for _ in range(10)]
    gc.collect(1)
    assert p.tick(now=1e9) == "busy"
    assert p.tick(now=1e9 + 1) == "frozen_cap"
    assert sample(metrics, "omni_process_gc_paced_collections_total", reason="frozen_cap") == 1
    del keep


def every_pass_is_timed_by_generation() -> None:
    activity = Activity()
    p, metrics = pacer(activity)
    p.install()
    full = sample(metrics, "omni_process_gc_pause_seconds_count", generation="2")
    young = sample(metrics, "omni_process_gc_pause_seconds_count", generation="0")
    gc.collect(0)
    gc.collect(2)
    assert sample(metrics, "omni_process_gc_pause_seconds_count", generation="2") == full + 1
    assert sample(metrics, "omni_process_gc_pause_seconds_count", generation="0") == young + 1
    assert sample(metrics, "omni_process_gc_pause_seconds_sum", generation="2") > 0


def zero_leaves_full_passes_to_cpython_and_stop_restores_it() -> None:
    before = gc.get_threshold()

    async def main() -> None:
        off, _ = pacer(Activity(), busy_pass_s=0.0)
        off.start()
        assert gc.get_threshold() == before and off._task is None
        await off.stop()
        on, _ = pacer(Activity())
        on.start()
        assert gc.get_threshold()[2] == AUTOMATIC_FULL_OFF and on._task is not None
        await on.stop()
        assert gc.get_threshold() == before and on._task is None

    asyncio.run(main())


def a_tick_without_a_pass_walks_no_frozen_list() -> None:
    activity = Activity()
    activity.in_flight = 1
    p, _ = pacer(activity)
    p.install()
    walks = []
    real = gc.get_freeze_count

    def counted() -> int:  # O(frozen objects) in CPython 3.11: 2 ms+ for a pod's start-up
        walks.append(1)
        return real()

    gc.get_freeze_count = counted  # type: ignore[assignment]
    try:
        for i in range(20):
            assert p.tick(now=p._last_pass + i * 0.5) is None  # busy, no pass due
            p.young_tick()
    finally:
        gc.get_freeze_count = real  # type: ignore[assignment]
    assert walks == []


def young(*gens: int) -> int:
    return sum(len(gc.get_objects(g)) for g in gens)


def a_busy_pod_takes_young_passes_and_an_idle_one_leaves_them_to_cpython() -> None:
    activity = Activity()
    p, metrics = pacer(activity)
    p.install()
    gc.disable()  # no automatic pass moves the objects below out of the young generations
    keep = [Cycle() for _ in range(5000)]  # live, as queued requests' objects are
    assert young(0, 1) >= 5000
    assert not p.young_tick()  # nothing in flight: no pass
    assert young(0, 1) >= 5000
    activity.in_flight = 800
    assert p.young_tick()
    assert young(0, 1) < 100  # moved to the old generation: later young passes skip them
    assert sample(metrics, "omni_process_gc_paced_collections_total", reason="young") == 1
    gc.enable()
    del keep


def young_passes_run_on_their_own_ticker_and_zero_turns_them_off() -> None:
    async def main() -> None:
        activity = Activity()
        activity.in_flight = 1
        on, metrics = pacer(activity, young_pass_s=0.01)
        on.start()
        await asyncio.sleep(0.2)
        await on.stop()
        passes = sample(metrics, "omni_process_gc_paced_collections_total", reason="young")
        assert passes >= 3, passes
        off, _ = pacer(activity, young_pass_s=0.0)
        off.start()
        assert off._task is not None and off._young_task is None
        await off.stop()

    asyncio.run(main())


SCENARIOS = {
    fn.__name__: fn
    for fn in (
        a_busy_pass_freezes_its_survivors_and_the_next_idle_moment_frees_them,
        no_full_pass_while_work_keeps_coming_before_the_busy_interval,
        an_idle_pass_waits_for_the_gap_and_for_something_to_collect,
        a_pod_that_never_idles_unfreezes_at_the_cap,
        every_pass_is_timed_by_generation,
        zero_leaves_full_passes_to_cpython_and_stop_restores_it,
        a_tick_without_a_pass_walks_no_frozen_list,
        a_busy_pod_takes_young_passes_and_an_idle_one_leaves_them_to_cpython,
        young_passes_run_on_their_own_ticker_and_zero_turns_them_off,
    )
}


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
    print(f"scenario {sys.argv[1]}: ok")
