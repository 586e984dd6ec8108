"""An autoscaled prefill pool end to end: ``tiny-llm`` split 1P:1D through a real ``omni-up``,
the prefill pool autoscaling between 1 and 2 replicas (``prefill: {autoscale: …}``, knobs set
so that a few clients cross the target at once and windows and cooldowns are short).

Under load from the ``openai`` SDK, the control plane's autoscaler asks for a second prefill
replica and omni-up starts it (``--role prefill``): it registers as ``headless/prefill`` and
serves prefills, whose KV the decode replica pulls. With the load gone (a slow trickle of
requests goes on), the pool shrinks back to 1: the newest replica is drained out of discovery
first, then retired (SIGTERM, exit 0). Every answer, before, during and after either change,
is the unsplit stage's for its seed (``tiny_llm_server``), none fails, every one was
prefilled remotely, and the decode pool is never touched.

The load signal is the prefill replicas' heartbeat (``sidecar/admission/load_report.py``): the
slots their prefills held on average since the previous heartbeat; vLLM's own counts, read
between steps, see none of a prefill's one step (tests/sidecar/test_load_report.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from omni_mesh.configs.autoscale import AutoscaleConfig
from tests.engines.vllm.servers import MODEL, Server, complete, handoffs, kv_metric, tiny_llm
from tests.procs import wait_until
from tests.procs.pods import ClientLoad

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEEDS = (11, 12, 13)
# A few clients put a prefill replica's utilization near 0.03-0.05 (0.5-0.8 of its 16 seqs held
# on average), a trickle (one client, 1 s apart) near 0.001: the target lies far from both. (With
# 0.5 s apart on a machine loaded by two other test runs, a trickle's prefills took long enough to
# average 0.06 and a third prefill replica was started.) The load must stay low for
# 8 s before the pool shrinks: on a busy machine the clients' load dipped to the target for
# 2-3 s, and the second replica was retired while it started.
POLICY = AutoscaleConfig(
    min_replicas=1,
    max_replicas=2,
    target_utilization=0.01,
    scale_up_window_s=0,
    scale_down_window_s=8,
    cooldown_s=1,
)
STARTED = re.compile(
    r"autoscale stage=0 pool=prefill starting process=(stage0-llm-prefill-1) pid=\d+ "
    r"on (http://[\d.]+:\d+)"
)
SERVED = f'omni_stage_requests_total{{outcome="ok",pipeline="{MODEL}",route="hop",stage="0"}}'


@pytest.fixture(scope="module")
def split(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("vllm-pd-autoscale")
    with tiny_llm(log_dir, prefill=1, decode=1, prefill_autoscale=POLICY) as server:
        assert len(server.stage_urls["prefill"]) == 1 and len(server.stage_urls["decode"]) == 1
        yield server


def served(server: Server, url: str) -> float:
    """The prefill hops the pod at ``url`` answered (from its /metrics)."""
    try:
        return server.metric(url, SERVED) or 0.0
    except OSError as exc:  # gone: say what omni-up saw
        raise AssertionError(f"{url}: {exc}\n{server.proc.stderr[-3000:]}") from exc


def role_and_state(status: str, url: str) -> tuple[str, ...]:
    """ROLE and STATE of the instance at ``url`` in ``omni-cp status`` (() when not listed)."""
    for row in status.splitlines():  # PIPELINE STAGE ROLE INSTANCE STATE ADDRESS …
        cells = row.split()
        if len(cells) > 5 and cells[5].removeprefix("http://") == url.removeprefix("http://"):
            return cells[2], cells[4]
    return ()


def test_the_prefill_pool_grows_under_load_and_shrinks_by_draining_when_it_is_gone(
    split: Server, tiny_llm_server: Server
) -> None:
    expected = {seed: complete(tiny_llm_server, seed) for seed in SEEDS}
    assert all(expected.values())

    def log() -> str:
        return split.proc.stderr[-3000:]

    # 1) Load: omni-up starts a second --role prefill replica, which registers in the prefill
    # pool and serves prefills, whose KV the decode replica pulls.
    with ClientLoad(lambda seed, stream: complete(split, seed, stream=stream), SEEDS, 4) as load:
        wait_until(lambda: STARTED.search(split.proc.stderr), 60, interval=0.2, message=log)
        started = STARTED.search(split.proc.stderr)
        assert started is not None
        name, url = started[1], started[2]
        wait_until(
            lambda: role_and_state(split.cp_status(), url) == ("headless/prefill", "healthy"),
            120, interval=0.5, message=lambda: f"{split.cp_status()}\n{log()}",
        )  # fmt: skip
        assert split.cp_status().count("headless/prefill") == 2
        wait_until(lambda: served(split, url) >= 10, 60, interval=0.2, message=log)
    assert load.failed() == [] and load.results, load.failed()[:3]
    assert load.wrong(expected) == [], load.wrong(expected)[:3]

    # 2) Only a trickle left: the pool goes back to 1. The new replica leaves discovery first
    # (drained), then gets SIGTERM and exits 0; the trickle's requests meanwhile all succeed.
    drained = re.compile(rf"autoscale stage=0 pool=prefill drained process={name} ")
    retired = re.compile(rf"retired process={name} pid=\d+ exited with code 0")
    with ClientLoad(
        lambda seed, stream: complete(split, seed, stream=stream), SEEDS, 1, pause_s=1.0
    ) as trickle:
        wait_until(lambda: retired.search(split.proc.stderr), 90, interval=0.2, message=log)
        time.sleep(1.0)  # requests after the retirement too
    assert trickle.failed() == [] and trickle.results, trickle.failed()[:3]
    assert trickle.wrong(expected) == [], trickle.wrong(expected)[:3]
    stderr = split.proc.stderr
    drain_at, retire_at = drained.search(stderr), re.search(rf"retiring process={name} ", stderr)
    assert drain_at is not None and retire_at is not None and drain_at.end() < retire_at.start()
    wait_until(
        lambda: split.cp_status().count("headless/prefill") == 1, 10, interval=0.5,
        message=split.cp_status,
    )  # fmt: skip
    status = split.cp_status()
    assert role_and_state(status, url) == () and status.count("headless/decode") == 1, status

    # Every answer was decoded from KV pulled from a prefill replica; the decode pool never
    # changed (not autoscaled). (A third prefill replica may start after the second retired: with
    # the suite's other worker busy, the trickle's prefills held 0.03 of the replica on average,
    # above this test's 0.01 target; the pool's growing and draining are asserted above.)
    calls = len(load.results) + len(trickle.results)
    wait_until(lambda: kv_metric(split, "decode", "pulled") >= calls, 10, interval=0.2)
    assert handoffs(split, "remote") == calls and handoffs(split, "local") == 0
    assert kv_metric(split, "decode", "failed") == 0
    assert "stage0-llm-decode-1" not in stderr
