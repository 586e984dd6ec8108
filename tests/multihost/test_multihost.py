"""Stages on several test hosts (network namespaces on a bridge; see ``fabric.py``), each
scenario under a little bounded load with zero failed requests:

1. a request path across three hosts (A -> B -> C, and A -> C -> C), with 16 MiB handed from
   A to B/C over HTTP and 1 MiB from C to C as a shared-memory handle;
2. a host cut off from the control plane only (silently): it keeps serving what reaches it,
   leaves the pools when its lease runs out, and rejoins once the control plane is back.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.multihost.fabric import S0_BYTES, S1_BYTES, Fabric, Load, http
from tests.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HANDOFF_BYTES = "omni_stage_handoff_bytes_total"
HOPS = "omni_stage_requests_total"


def _hops(fabric: Fabric, pod: str) -> float:
    return fabric.pods[pod].metric(HOPS, route="hop")


def test_request_path_across_three_hosts(fabric: Fabric) -> None:
    a = fabric.hosts["a"]
    sent = {p: fabric.pods[p].metric(HANDOFF_BYTES) for p in ("s0", "s1b", "s1c")}
    hops = {p: _hops(fabric, p) for p in ("s1b", "s1c", "s2")}
    with Load(fabric, a) as load:
        load.wait_ok(24)
    assert load.failures == [], load.failures[:3]
    done = load.statuses.count(200)
    delta = {p: _hops(fabric, p) - hops[p] for p in hops}
    assert delta["s2"] >= done
    assert delta["s1b"] > 0 and delta["s1c"] > 0, f"requests did not spread over B and C: {delta}"

    sent_by = {p: fabric.pods[p].metric(HANDOFF_BYTES) - sent[p] for p in sent}
    # A -> B/C crosses hosts: the 16 MiB travel over HTTP, once per request
    assert sent_by["s0"] >= done * S0_BYTES, sent_by
    # B -> C crosses hosts: 1 MiB per request in the body
    assert sent_by["s1b"] >= delta["s1b"] * S1_BYTES * 0.99, sent_by
    # C -> C stays on the host: shared memory, the hop body carries a handle only
    assert sent_by["s1c"] < delta["s1c"] * 64 * 1024, sent_by

    # the answer is the 3-stage result, the same outputs whichever hosts it crossed (its
    # usage, the engine time each stage spent on it, differs run to run)
    status, body = a.run(lambda: http(fabric.api_url + "/v1/generate", {"prompt": "x", "seed": 7}))
    assert status == 200, body[:300]
    again = [a.run(lambda: http(fabric.api_url + "/v1/generate", {"prompt": "x", "seed": 7}))]
    assert again[0][0] == 200
    assert json.loads(again[0][1])["outputs"] == json.loads(body)["outputs"]


def test_host_cut_off_from_control_plane_keeps_serving_and_rejoins(fabric: Fabric) -> None:
    a, b, cp = fabric.hosts["a"], fabric.hosts["b"], fabric.hosts["cp"]
    s1b = fabric.pods["s1b"].url
    wait_until(lambda: s1b in fabric.pool(1), 30)
    with Load(fabric, a) as load:
        load.wait_ok(10)
        b.drop_to(cp)  # silent: B's heartbeats vanish; A and C still reach B
        try:
            # B keeps serving what reaches it (a /v1/run straight to it)
            status, body = a.run(
                lambda: http(
                    fabric.api_url + "/v1/run", {"stage_id": 0, "stage_input": {"prompt": "cut"}}
                )
            )
            assert status == 200, body[:300]
            stage_input = json.loads(body)["stage_input"]
            status, body = a.run(
                lambda: http(s1b + "/v1/run", {"stage_id": 1, "stage_input": stage_input})
            )
            assert status == 200, body[:300]
            assert json.loads(body)["next_stage_id"] == 2
            # its lease runs out: omni-cp takes it out of the pool, traffic goes on via C
            wait_until(lambda: s1b not in fabric.pool(1), 20, message="B never left the pool")
            load.wait_ok(10)
        finally:
            b.heal(cp)
        t_heal = time.monotonic()
        wait_until(lambda: s1b in fabric.pool(1), 30, message="B never rejoined the pool")
        rejoined_s = time.monotonic() - t_heal
        before = _hops(fabric, "s1b")
        load.wait_ok(16)
        wait_until(lambda: _hops(fabric, "s1b") > before, 30, message="no traffic to B after")
    print(f"\ncut off from the control plane: rejoined {rejoined_s:.2f}s after the link healed")
    assert load.failures == [], load.failures[:3]
    assert fabric.pods["s1b"].proc.alive
