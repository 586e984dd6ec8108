"""Prefill/decode split of a vLLM stage (deploy ``prefill:``) through ``omni-up``, real vLLM
engines and real NIXL (vLLM's ``NixlConnector`` on host memory): ``tiny-llm`` split 1P:2D.
A request is prefilled on the prefill replica, its KV cache pulled engine to engine by a decode
replica, which generates: the answers, streamed and not, are those of the unsplit stage
(``tiny_llm_server``, the same settings) for the same seed; the decode replicas' engines count
the pulls and their bytes, the API server the hand-offs, ``omni-cp status`` shows each pool.
Killing the prefill replica (its pod and engine, SIGKILL) and then a decode replica under load
fails no request and changes no answer: hops whose prefill replica is gone are prefilled by
the decode replica (counted ``local``), a pull from the dead engine fails and is prefilled
again where it is (counted ``failed``), a decode stream cut mid-way is replayed, prefill
included, elsewhere. Idle, the split stage's engines leave the cores alone (NIXL's progress
thread paced). A prefill whose KV nobody pulls (a prefill request sent straight to the
prefill replica) is freed when its lease runs out, counted ``expired``; a decode whose pull
fails (params of an engine that is gone) gives the answer of a local prefill, counted
``failed``. ``--role`` on a stage
that is not split exits 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import msgspec
import pytest

from omni_mesh.data_plane.kv_transfer import PREFILL_REQUEST
from omni_mesh.data_plane.messages import Payload, StageInput
from tests.engines.vllm.servers import (
    MODEL,
    SECRET,
    Server,
    complete,
    handoffs,
    kv_metric,
    tiny_llm,
)
from tests.procs import free_port, wait_until
from tests.procs.hops import hop_text, send_hop
from tests.procs.pods import engine_pids, idle_core_shares, kills_under_load, pod_and_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEEDS = (1, 2, 3)
LEASE_S = 3  # how long the prefill replica keeps KV nobody pulls (engine_extras.kv_lease_s)


@pytest.fixture(scope="module")
def split(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("vllm-pd")
    with tiny_llm(log_dir, prefill=1, decode=2, kv_lease_s=LEASE_S) as server:
        assert len(server.stage_urls["prefill"]) == 1 and len(server.stage_urls["decode"]) == 2
        yield server


def test_the_split_stage_answers_as_the_unsplit_one_with_the_kv_pulled(
    split: Server, tiny_llm_server: Server
) -> None:
    pulled = kv_metric(split, "decode", "pulled")
    for seed in SEEDS:
        expected = complete(tiny_llm_server, seed)
        assert expected and complete(split, seed) == expected
        assert complete(split, seed, stream=True) == expected
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    a = split.client.chat.completions.create(seed=5, temperature=1.0, **chat)  # type: ignore[call-overload]
    b = tiny_llm_server.client.chat.completions.create(seed=5, temperature=1.0, **chat)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    # The decode engines pulled the KV (NIXL), bytes counted; the API server handed off.
    wait_until(lambda: kv_metric(split, "decode", "pulled") >= pulled + 7, 10, interval=0.2)
    bytes_line = f'omni_stage_kv_transfer_bytes_total{{pipeline="{MODEL}",stage="0"}}'
    assert sum(split.metric(u, bytes_line) or 0.0 for u in split.stage_urls["decode"]) > 0
    assert handoffs(split, "remote") >= 7 and handoffs(split, "local") == 0
    assert kv_metric(split, "decode", "failed") == 0
    assert kv_metric(split, "prefill", "pulled") == 0  # the prefill engine only serves reads
    # Each replica reports the prompt tokens its engine has not prefilled yet: none, idle.
    queued = f'omni_stage_prefill_tokens_queued{{pipeline="{MODEL}",stage="0"}}'
    urls = split.stage_urls["prefill"] + split.stage_urls["decode"]
    wait_until(lambda: [split.metric(u, queued) for u in urls] == [0.0] * 3, 10, interval=0.2)
    status = split.cp_status()
    assert status.count("headless/prefill") == 1, status
    assert status.count("headless/decode") == 2, status


def _input(request_id: str, seed: int, kv_transfer: str, **fields: str | int) -> StageInput:
    """A hop's input for the tiny-llm stage, as a sender builds it."""
    return StageInput(
        pipeline=MODEL,
        request_id=request_id,
        stage_id=0,
        deadline_ms=int((time.time() + 60) * 1000),
        seed=seed,
        payload=Payload(fields=dict(fields)),
        kv_transfer=kv_transfer,
    )


def test_kv_that_nobody_pulls_is_freed_when_its_lease_runs_out(split: Server) -> None:
    # A prefill request sent straight to the prefill replica (as a sender does first) whose
    # KV no decode replica ever pulls: the answer says where the KV waits, and nothing else.
    prefill = split.stage_urls["prefill"][0]
    expired = kv_metric(split, "prefill", "expired")
    si = _input("unpulled-1", 1, PREFILL_REQUEST, prompt="nobody will pull this prompt's cache")
    [answer] = send_hop(prefill, si, SECRET)
    assert answer.error is None and not answer.outputs, answer
    params = json.loads(answer.kv_transfer)
    assert params["remote_engine_id"] and params["remote_block_ids"], params
    # The prefill engine holds the blocks for a pull that never comes, then frees them (an
    # idle engine steps while it holds any: vLLM checks leases inside a step).
    wait_until(
        lambda: kv_metric(split, "prefill", "expired") >= expired + 1,
        LEASE_S + 20,
        interval=0.5,
        message=lambda: split.proc.stderr[-2000:],
    )
    assert complete(split, SEEDS[0])  # and it keeps serving


def test_a_pull_that_fails_is_prefilled_where_it_is(split: Server) -> None:
    # Params of a prefill engine that is gone (nothing listens on its side channel): the pull
    # fails inside vLLM, and the decode engine runs the request again with its own prefill.
    decode = split.stage_urls["decode"][0]
    failed = kv_metric(split, "decode", "failed")
    gone = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
        "remote_engine_id": "a-gone-engine", "remote_request_id": "gone-1",
        "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1, "dcp_size": 1,
        "pp_size": 1, "remote_num_tokens": 24, "remote_blocks_expiry_time": None,
        "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
    }  # fmt: skip
    si = _input(
        "pull-from-nowhere", 4, json.dumps(gone), prompt="a pull from nowhere", max_tokens=8
    )
    pulled_text = hop_text(send_hop(decode, si, SECRET))
    local = msgspec.structs.replace(si, request_id="prefilled-here", kv_transfer="")
    assert pulled_text and pulled_text == hop_text(send_hop(decode, local, SECRET))
    wait_until(lambda: kv_metric(split, "decode", "failed") >= failed + 1, 10, interval=0.2)


def test_idle_split_engines_leave_the_cores_alone(split: Server) -> None:
    # NIXL's progress thread spins a whole core per engine unless paced (kv_split.py): idle,
    # every engine of the split stage must use a small part of one.
    urls = [url for pool in split.stage_urls.values() for url in pool]
    engines = engine_pids(split.proc.pid, urls)
    assert len(engines) == 3, engines
    used = idle_core_shares(engines)
    assert all(share < 0.3 for share in used.values()), used  # cores per engine, idle


def test_killing_the_prefill_and_a_decode_replica_under_load_fails_nothing(
    split: Server, tiny_llm_server: Server
) -> None:
    expected = {seed: complete(tiny_llm_server, seed) for seed in SEEDS}
    prefill, decode = split.stage_urls["prefill"][0], split.stage_urls["decode"][1]
    victims = [pod_and_engine(split.proc.pid, prefill), pod_and_engine(split.proc.pid, decode)]
    results = kills_under_load(
        lambda seed, stream: complete(split, seed, stream=stream),
        SEEDS,
        victims,  # the prefill replica (its pod and its vLLM engine), then a decode replica
        workers=6,
        pauses_s=(2.0, 3.0, 3.0),
    )
    failed = [r for r in results if not isinstance(r[1], str)]
    assert failed == [] and len(results) > 20, failed[:3]
    assert all(text == expected[seed] for seed, text in results), results
    # With the prefill pool gone, hops were prefilled by a decode replica (omni-up restarts
    # the killed replicas meanwhile).
    assert handoffs(split, "local") >= 1
    assert re.search(
        r"process=stage0-llm-prefill-0 pid=\d+ was killed by SIGKILL", split.proc.stderr
    )


def test_role_needs_a_split_stage(vllm_env: dict[str, str]) -> None:
    argv = ["--pipeline", MODEL, "--stage-id", "0", "--role", "prefill", "--port", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc
    assert "--role prefill: stage 0 is not split" in proc.stderr
