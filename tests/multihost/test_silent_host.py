"""Silent network failures across test hosts (see ``fabric.py``), under a little bounded load:

1. host B's link goes down mid-load (packets vanish, no resets): its in-flight hops are replayed
   on host C within about a second, B leaves the pool, and rejoins after its link comes back;
2. the router host A is cut off (silently) from B but not from the control plane: A's hops go
   to C, and B stays in the pool the other routers see (A's suspicion does not poison it).

What makes it about a second, not TCP's minutes: a hop's connection must be made within
``hop_connect_timeout_s`` (0.3 s), and a replica with a hop unanswered for ``hop_probe_after_s``
(0.5 s) is probed on ``/health`` by the sender; a failed probe fails its outstanding hops, which
are replayed (``omni_mesh/sidecar/hop/liveness.py``). Each test checks that replays did happen.
"""

from __future__ import annotations

import time

import pytest

from omni_mesh.observability.metrics import CP_PROBES, SC_HOP_RETRIES
from tests.multihost.fabric import Fabric, Load
from tests.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: A replay "within about a second" (0.5 + 0.1 + 0.3 s by default), plus slack for 2 cores.
MAX_LATENCY_S = 3.0
HOP_RETRIES = SC_HOP_RETRIES + "_total"
#: The clients give up after this: a hung hop shows as a failure, not as a hung test.
CLIENT_TIMEOUT_S = 12.0


def replays(fabric: Fabric) -> float:
    """Hops from stage 0 (host A) to stage 1 replayed on another replica so far."""
    return fabric.pods["s0"].metric(HOP_RETRIES, from_stage="0", to_stage="1")


def test_silent_link_down_replays_within_a_second(fabric: Fabric) -> None:
    a, b = fabric.hosts["a"], fabric.hosts["b"]
    s1b = fabric.pods["s1b"].url
    wait_until(lambda: s1b in fabric.pool(1), 30)
    with Load(fabric, a, workers=3, timeout=CLIENT_TIMEOUT_S) as load:
        load.wait_ok(10)
        first, replayed = len(load.latencies), replays(fabric)
        b.link_down()
        try:
            wait_until(lambda: s1b not in fabric.pool(1), 20, message="B never left the pool")
            load.wait_ok(10, timeout=CLIENT_TIMEOUT_S * 3)
        finally:
            b.link_up()
        wait_until(lambda: s1b in fabric.pool(1), 30, message="B never rejoined the pool")
        load.wait_ok(10, timeout=CLIENT_TIMEOUT_S * 3)
    assert load.failures == [], load.failures[:3]
    assert replays(fabric) > replayed, "no hop to B was replayed: the test proved nothing"
    worst = max(load.latencies[first:])
    assert worst < MAX_LATENCY_S, f"a request took {worst:.1f}s (no replay within a second)"


def test_router_cut_off_from_one_host_goes_elsewhere(fabric: Fabric) -> None:
    a, b = fabric.hosts["a"], fabric.hosts["b"]
    s1b = fabric.pods["s1b"].url
    wait_until(lambda: s1b in fabric.pool(1), 30)
    with Load(fabric, a, workers=3, timeout=CLIENT_TIMEOUT_S) as load:
        load.wait_ok(10)
        first, replayed = len(load.latencies), replays(fabric)
        alive = fabric.cp_metric(CP_PROBES + "_total", stage="1", outcome="answered")
        a.drop_to(b)  # A <-> B silent; the control plane still reaches both
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6.0:  # the pool others see keeps B throughout
                assert s1b in fabric.pool(1), "A's suspicion took B out of everyone's pool"
                time.sleep(0.2)
            load.wait_ok(10, timeout=CLIENT_TIMEOUT_S * 3)
        finally:
            a.heal(b)
    assert load.failures == [], load.failures[:3]
    # A did report B; the control plane probed it from its own host, found it alive, kept it.
    assert fabric.cp_metric(CP_PROBES + "_total", stage="1", outcome="answered") > alive
    assert replays(fabric) > replayed, "no hop to B was replayed: the test proved nothing"
    worst = max(load.latencies[first:])
    assert worst < MAX_LATENCY_S, f"a request took {worst:.1f}s (its hop to B hung)"
