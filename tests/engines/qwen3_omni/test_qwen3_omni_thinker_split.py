"""The qwen3-omni thinker split into prefill and decode engines (deploy ``prefill:``), with real
NIXL between two engines of this process (``engines/batching/kv_split.py``,
``engines/kv/exchange.py``).

A prefill engine answers a prefill request with params and nothing else; a decode engine given
those params pulls the prompt's state (KV cache, first token, positions, generator, hidden
states) and its answer is the unsplit engine's, bit for bit (every array and field), greedy and
sampled, with audio input too; pulled rows join a batch already running and keep their tokens,
and stream the same text. The prefill engine frees what was pulled (the read's notification)
and what nobody pulled within its lease (counted expired; its slot reused only once a pull
started in time would have ended); params the decode engine cannot use
(not JSON, not a prefill's, another version, out-of-range numbers, an unaligned tensor, a slot
outside the prefill engine's registered memory, metadata that is not an agent's or is another
agent's, another prompt's state, a slot freed and reused since: a second pull) or a prefill engine
that died after answering make it prefill the request itself, counted failed, with the same
answer; an aborted pull frees its receive slot;
a full hold buffer fails the prefill (the sender then has the decode replica prefill)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.configs.stage_deploy import PrefillPool
from omni_mesh.data_plane.kv_transfer import PREFILL_REQUEST
from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.engines.base import (
    EngineConfigError,
    EngineContext,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
    import_object,
)
from omni_mesh.engines.kv.exchange import KvExchange
from tests.engines.batching.drive import drive
from tests.engines.helpers import make_engine
from tests.engines.qwen3_omni.omni_reference import CHATS
from tests.procs.polling import wait_until

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SAMPLED = SamplingParams(temperature=1.3)


def split_engine(stage_id: int = 0, **extras: Any) -> StageEngine:
    """A loaded qwen3-omni engine of a split stage (``prefill: {num_replicas: 1}``)."""
    spec = get_pipeline("qwen3-omni")
    stage = spec.stage(stage_id)
    config = StageDeployConfig(
        stage_id=stage_id, prefill=PrefillPool(num_replicas=1), engine_extras=extras
    )
    engine: StageEngine = import_object(stage.engine)(EngineContext(spec, stage, config))
    engine.load()
    return engine


def exchange(engine: StageEngine) -> KvExchange:
    kv = getattr(engine, "kv", None)
    assert kv is not None
    return kv.exchange  # type: ignore[no-any-return]


class Engines:
    def __init__(self) -> None:
        self.whole = make_engine("qwen3-omni", 0)
        self.prefill = split_engine()
        self.decode = split_engine()

    def close(self) -> None:
        for engine in (self.whole, self.prefill, self.decode):
            engine.close()


@pytest.fixture(scope="module")
def engines() -> Any:
    both = Engines()
    yield both
    both.close()


def chat(index: int) -> StageData:
    messages, tokens = CHATS[index]
    return StageData(fields={"messages": json.dumps(messages), "max_tokens": tokens})


def one(engine: StageEngine, request: EngineRequest) -> EngineResult:
    (result,) = engine.execute([request])
    return result


def prefilled(engines: Engines, index: int, seed: int, sampling: Any = None) -> str:
    answer = one(
        engines.prefill,
        EngineRequest(f"p{index}", seed, chat(index), sampling, kv_transfer=PREFILL_REQUEST),
    )
    assert answer.error is None, answer.error
    assert answer.kv_transfer and not answer.output.arrays and answer.final is None
    return answer.kv_transfer


def assert_same(got: EngineResult, want: EngineResult) -> None:
    assert got.error is None, got.error
    assert got.final is not None and want.final is not None
    assert got.final.fields == want.final.fields
    assert got.output.fields == want.output.fields
    assert set(got.output.arrays) == set(want.output.arrays)
    for name, array in want.output.arrays.items():
        assert np.array_equal(got.output.arrays[name], array), name


def freed(engine: StageEngine) -> bool:
    engine.idle()  # reads the pulls' notifications, frees expired holds
    return exchange(engine).held == 0


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_a_pulled_prefill_decodes_as_the_unsplit_thinker(
    engines: Engines, sampling: SamplingParams | None
) -> None:
    counts = exchange(engines.decode).counts
    pulled, pulled_bytes = counts.pulled, counts.pulled_bytes
    for index in range(len(CHATS)):  # text, audio in, a long prompt, a short answer
        seed = 11 + index
        want = one(engines.whole, EngineRequest("w", seed, chat(index), sampling))
        params = prefilled(engines, index, seed, sampling)
        got = one(
            engines.decode, EngineRequest("d", seed, chat(index), sampling, kv_transfer=params)
        )
        assert_same(got, want)
    assert counts.pulled == pulled + len(CHATS) and counts.failed == 0
    assert counts.pulled_bytes > pulled_bytes and counts.pulled_s > 0
    assert exchange(engines.decode).receive.used == 0
    wait_until(lambda: freed(engines.prefill), 10, interval=0.05)  # the reads' notifications
    assert exchange(engines.prefill).holds.used == 0
    stats = engines.decode.stats()
    assert stats is not None and stats.kv_pulled == counts.pulled
    assert stats.kv_pulled_bytes == counts.pulled_bytes


def test_pulled_rows_join_a_running_batch_and_keep_their_tokens(engines: Engines) -> None:
    # A local row runs; two pulled rows join it at later steps: each answer is its own alone.
    wants = {i: one(engines.whole, EngineRequest("w", 30 + i, chat(i))) for i in range(3)}
    params = {i: prefilled(engines, i, 30 + i) for i in (1, 2)}
    arrivals = {
        0: [EngineRequest("r0", 30, chat(0))],
        1: [EngineRequest("r1", 31, chat(1), kv_transfer=params[1])],
        3: [EngineRequest("r2", 32, chat(2), kv_transfer=params[2])],
    }
    counts = exchange(engines.decode).counts
    pulled, failed = counts.pulled, counts.failed
    results, errors = drive(engines.decode, arrivals)
    assert errors == {}
    assert (counts.pulled, counts.failed) == (pulled + 2, failed)  # not prefilled here
    for i, want in wants.items():
        (got,) = results[f"r{i}"]
        assert got.final is not None and want.final is not None
        assert got.final.fields == want.final.fields  # the tokens (batched: arrays move in
        assert np.array_equal(  # their last bits, test_qwen3_omni_thinker_batching.py)
            got.output.arrays["sequences"], want.output.arrays["sequences"]
        )


def test_a_pulled_row_streams_the_unsplit_text(engines: Engines) -> None:
    want = one(engines.whole, EngineRequest("w", 41, chat(2)))
    params = prefilled(engines, 2, 41)
    decode = engines.decode
    pulled = exchange(decode).counts.pulled
    whole_ctx = decode.ctx
    decode.ctx = dataclasses.replace(whole_ctx, async_chunk=True)
    try:
        results, errors = drive(decode, {0: [EngineRequest("s", 41, chat(2), kv_transfer=params)]})
    finally:
        decode.ctx = whole_ctx
    assert errors == {} and exchange(decode).counts.pulled == pulled + 1
    chunks = results["s"]
    assert len(chunks) > 2 and chunks[-1].last
    text = "".join(str(c.final.fields["text"]) for c in chunks if c.final is not None)
    assert want.final is not None and text == want.final.fields["text"]


def _tampered(params: str, **changes: Any) -> str:
    fields = json.loads(params)
    fields.update(changes)
    return json.dumps(fields)


def test_params_a_decode_cannot_use_make_it_prefill_here(engines: Engines) -> None:
    params = prefilled(engines, 0, 50)
    fields = json.loads(params)
    unaligned = [list(t) for t in fields["tensors"]]
    unaligned[1][3] += 4  # an offset off its alignment
    bad = {
        "not JSON": "{not json",
        "not a prefill's": json.dumps({"remote_engine_id": "x"}),
        "another version": _tampered(params, v=2),
        "an infinite address": params.replace(f'"addr":{fields["addr"]}', '"addr":1e999'),
        "nested too deep": "[" * 100_000 + "]" * 100_000,
        "an unaligned tensor": _tampered(params, tensors=unaligned),
        "outside the registered memory": _tampered(params, addr=fields["addr"] + (1 << 40)),
        "not an agent's metadata": _tampered(params, agent="bm90IG1ldGFkYXRh"),
        "another agent's metadata": _tampered(params, remote_engine_id="someone-else"),
        "another prompt's state": prefilled(engines, 2, 50),
    }
    want = one(engines.whole, EngineRequest("w", 50, chat(0)))
    counts = exchange(engines.decode).counts
    for why, text in bad.items():
        failed, pulled = counts.failed, counts.pulled
        got = one(engines.decode, EngineRequest("d", 50, chat(0), kv_transfer=text))
        assert_same(got, want)
        assert (counts.failed, counts.pulled) == (failed + 1, pulled), why
        assert exchange(engines.decode).receive.used == 0, why
    # the good params were never pulled: their hold waits (until its lease)
    assert exchange(engines.prefill).held >= 1
    got = one(engines.decode, EngineRequest("d", 50, chat(0), kv_transfer=params))
    assert_same(got, want)
    wait_until(lambda: freed(engines.prefill), 10, interval=0.05)


def test_a_second_pull_of_a_reused_slot_prefills_here(engines: Engines) -> None:
    wait_until(lambda: freed(engines.prefill), 10, interval=0.05)
    want = one(engines.whole, EngineRequest("w", 60, chat(3), SAMPLED))
    first = prefilled(engines, 3, 60, SAMPLED)  # sampled: its generator's state moves too
    pulled = one(engines.decode, EngineRequest("d", 60, chat(3), SAMPLED, kv_transfer=first))
    assert_same(pulled, want)
    wait_until(lambda: freed(engines.prefill), 10, interval=0.05)
    second = prefilled(engines, 3, 61, SAMPLED)  # another seed, in the freed slot
    assert json.loads(second)["addr"] == json.loads(first)["addr"]
    counts = exchange(engines.decode).counts
    failed = counts.failed
    again = one(engines.decode, EngineRequest("d", 60, chat(3), SAMPLED, kv_transfer=first))
    assert_same(again, want)  # not seed 61's state: prefilled here
    assert counts.failed == failed + 1
    one(engines.decode, EngineRequest("d", 61, chat(3), SAMPLED, kv_transfer=second))
    wait_until(lambda: freed(engines.prefill), 10, interval=0.05)


def test_kv_nobody_pulls_is_freed_when_its_lease_runs_out() -> None:
    engine = split_engine(kv_lease_s=1, kv_pull_timeout_s=0.5)
    try:
        answer = one(engine, EngineRequest("p", 1, chat(0), kv_transfer=PREFILL_REQUEST))
        assert answer.kv_transfer and exchange(engine).held == 1
        engine.idle()
        assert exchange(engine).held == 1  # not before its lease
        time.sleep(1.1)
        engine.idle()
        # expired; its slot is reused only after a pull started in time would have ended
        assert exchange(engine).held == 0 and exchange(engine).holds.used > 0
        time.sleep(1.6)  # kv_pull_timeout_s + 1
        engine.idle()
        assert exchange(engine).holds.used == 0
        stats = engine.stats()
        assert stats is not None and stats.kv_expired == 1 and stats.kv_pulled == 0
    finally:
        engine.close()


def test_an_aborted_pull_frees_its_receive_slot(engines: Engines) -> None:
    params = prefilled(engines, 1, 70)
    decode = engines.decode
    (stream,) = decode.open([EngineRequest("a", 70, chat(1), kv_transfer=params)])
    assert exchange(decode).receive.used > 0  # the read started
    stream.close()  # type: ignore[attr-defined]

    def settled() -> bool:
        decode.idle()
        return exchange(decode).receive.used == 0 and not decode.batch.busy  # type: ignore[attr-defined]

    wait_until(settled, 10, interval=0.05)
    wait_until(lambda: freed(engines.prefill), 10, interval=0.05)


def test_a_full_hold_buffer_fails_the_prefill() -> None:
    engine = split_engine(kv_buffer_mib=1)
    try:
        errors = []
        for n in range(200):  # ~70 KB each: the 1 MiB buffer fills long before
            answer = one(engine, EngineRequest(f"p{n}", n, chat(2), kv_transfer=PREFILL_REQUEST))
            if answer.error is not None:
                errors.append(answer.error)
                break
        assert errors and "kv_buffer_mib" in errors[0], errors
        assert exchange(engine).held == n
    finally:
        engine.close()


def test_only_the_thinker_of_qwen3_omni_splits() -> None:
    with pytest.raises(EngineConfigError, match="prefill: splits a stage"):
        split_engine(stage_id=1)


GONE = """
import json, os, sys
from omni_mesh.data_plane.kv_transfer import PREFILL_REQUEST
from omni_mesh.engines.base import EngineRequest
from tests.engines.qwen3_omni.test_qwen3_omni_thinker_split import chat, split_engine
engine = split_engine()
(answer,) = engine.execute([EngineRequest("p", 80, chat(1), kv_transfer=PREFILL_REQUEST)])
sys.stdout.write("PARAMS " + answer.kv_transfer + "\\n")
sys.stdout.flush()
os._exit(0)
"""


def test_a_pull_from_a_prefill_engine_that_died_prefills_here(engines: Engines) -> None:
    # The prefill replica answered, then died before the decode replica pulled.
    proc = subprocess.run([sys.executable, "-c", GONE], capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PARAMS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    params = lines[0].removeprefix("PARAMS ")
    want = one(engines.whole, EngineRequest("w", 80, chat(1)))
    counts = exchange(engines.decode).counts
    failed, pulled = counts.failed, counts.pulled
    got = one(engines.decode, EngineRequest("d", 80, chat(1), kv_transfer=params))
    assert_same(got, want)
    assert (counts.failed, counts.pulled) == (failed + 1, pulled)
    assert exchange(engines.decode).receive.used == 0
