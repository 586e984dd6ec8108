"""The hop client's side of a split stage (``data_plane/kv_transfer.py``), against loopback
receivers that play a prefill and a decode replica: the input goes to the prefill pool first
(``kv_transfer`` a prefill request), its answer's KV params go with the input to a decode
replica, and nothing else reaches the prefill pool. When no prefill replica can (none left,
failed, a bad answer) the decode replica gets the input with no params: it prefills for
itself. Each outcome is counted in the hop's stats; an unsplit pool sees none of this. The
router counts a prefill's prompt tokens on its replica until it answers, fails or is given up."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterable

import numpy as np
import pytest
from aiohttp import web

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.connectors import HttpConnector
from omni_mesh.data_plane.constants import MSGPACK
from omni_mesh.data_plane.kv_transfer import PREFILL_REQUEST, KvTransferError, decode_params
from omni_mesh.data_plane.messages import HopResult, Payload, StageError, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.data_plane.tensors import tensor_from_array
from omni_mesh.sidecar.hop.budget import HopStats
from omni_mesh.sidecar.hop.client import HopClient
from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.router import Replica, Router
from tests.sidecar.hops import send, serve_hops

pytestmark = pytest.mark.unit

STAGE = 1
PARAMS = '{"remote_engine_id":"engine-p","remote_block_ids":[[1,2]],"remote_port":5600}'


class Receiver:
    """A loopback replica of a split stage: ``prefill`` answers prefill requests with
    :data:`PARAMS` (or ``answer_status`` / ``bad_answer``); ``decode`` echoes what it got."""

    def __init__(self, name: str, kv_role: str) -> None:
        self.name = name
        self.kv_role = kv_role
        self.got: list[str] = []  # kv_transfer of every input received
        self.attempts: list[int] = []
        self.answer_status = 200
        self.bad_answer = False
        self.arrived = asyncio.Event()  # a hop reached it
        self.hold: asyncio.Event | None = None  # set: answers once it is set
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> Receiver:
        self.runner, self.port = await serve_hops(self.hop)
        return self

    async def hop(self, request: web.Request) -> web.Response:
        si = codec.decode(await request.read(), StageInput)
        self.got.append(si.kv_transfer)
        self.attempts.append(si.attempt)
        self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.answer_status != 200:
            return web.Response(status=self.answer_status, text="engine died")
        if si.kv_transfer == PREFILL_REQUEST:
            error = StageError(code="engine_error", message="no KV", stage_id=STAGE)
            result = (
                HopResult(request_id=si.request_id, error=error)
                if self.bad_answer
                else HopResult(request_id=si.request_id, kv_transfer=PARAMS)
            )
        else:
            fields = {"by": self.name, "kv": si.kv_transfer}
            result = HopResult(request_id=si.request_id, outputs={2: Payload(fields=fields)})
        return web.Response(body=codec.encode(result), content_type=MSGPACK)

    def replica(self) -> Replica:
        url = f"http://127.0.0.1:{self.port}"
        return Replica(self.name, STAGE, url, "host-b", capacity=8, kv_role=self.kv_role)


class Pools:
    def __init__(self, *replicas: Replica) -> None:
        self.members = list(replicas)

    def replicas(self, stage_id: int) -> Iterable[Replica]:
        return list(self.members)


@pytest.fixture
async def servers() -> AsyncIterator[list[Receiver]]:
    started: list[Receiver] = []
    yield started
    for s in started:
        assert s.runner is not None
        await s.runner.cleanup()


async def start(servers: list[Receiver], name: str, kv_role: str) -> Receiver:
    r = await Receiver(name, kv_role).start()
    servers.append(r)
    return r


async def hop_once(
    pools: Pools,
    retries: int = 1,
    *,
    router: Router | None = None,
    payload: Payload | None = None,
) -> tuple[HopResult, HopStats]:
    http, reader = HopHttpClient(), ShmReader()
    stats: list[HopStats] = []
    router = router or Router(pools, host_id="host-a", rng=random.Random(1))
    connector = HttpConnector()
    hop = HopClient(
        http,
        router,
        lambda a, b: connector,
        reader,
        retries=retries,
        on_hop=lambda si, s: stats.append(s),
    )
    si = StageInput(
        pipeline="tiny-llm",
        request_id="r-1",
        stage_id=STAGE,
        from_stage=0,
        deadline_ms=int((time.time() + 10) * 1000),
        seed=1,
        payload=payload or Payload(fields={"prompt": "p"}),
    )
    try:
        result = await send(hop, si)
    finally:
        await http.close()
        reader.close()
    return result, stats[0]


async def test_a_split_stage_prefills_on_the_prefill_pool_then_decodes_with_its_params(
    servers: list[Receiver],
) -> None:
    p = await start(servers, "p", "prefill")
    d1, d2 = await start(servers, "d1", "decode"), await start(servers, "d2", "decode")
    pools = Pools(p.replica(), d1.replica(), d2.replica())
    for _ in range(4):
        result, stats = await hop_once(pools)
        assert result.error is None and result.outputs[2].fields["kv"] == PARAMS
        assert stats.kv_handoffs == ["remote"]
    assert p.got == [PREFILL_REQUEST] * 4  # the prefill pool sees prefill requests only
    assert sorted(d1.got + d2.got) == [PARAMS] * 4  # never a prefill request to a decode one


async def test_without_a_prefill_replica_that_can_the_decode_replica_prefills(
    servers: list[Receiver],
) -> None:
    p, d = await start(servers, "p", "prefill"), await start(servers, "d", "decode")
    p.answer_status = 503  # the prefill replica fails: ejected, the decode one prefills
    result, stats = await hop_once(Pools(p.replica(), d.replica()))
    assert result.outputs[2].fields == {"by": "d", "kv": ""}
    assert stats.kv_handoffs == ["local"] and p.got == [PREFILL_REQUEST]
    p.answer_status, p.bad_answer = 200, True  # an answer without params: the same
    result, stats = await hop_once(Pools(p.replica(), d.replica()))
    assert result.outputs[2].fields["kv"] == "" and stats.kv_handoffs == ["local"]
    # A decode pool alone (the prefill pool is gone) is still a split stage: local prefill.
    result, stats = await hop_once(Pools(d.replica()))
    assert result.outputs[2].fields["kv"] == "" and stats.kv_handoffs == ["local"]


async def test_a_decode_retried_elsewhere_prefills_there_not_reading_freed_blocks(
    servers: list[Receiver],
) -> None:
    # The first decode replica fails before it answers (it may have pulled the KV already,
    # and the prefill engine freed it then): the retry goes without the params.
    p = await start(servers, "p", "prefill")
    d1, d2 = await start(servers, "d1", "decode"), await start(servers, "d2", "decode")
    d1.answer_status = 503
    pools = Pools(p.replica(), d1.replica(), d2.replica())
    for _ in range(6):  # until P2C has tried d1 first once
        result, stats = await hop_once(pools)
        assert result.error is None and result.outputs[2].fields["by"] == "d2"
        if d1.got:
            break
    assert d1.got == [PARAMS] and d2.got[-1] == "" and stats.kv_handoffs == ["remote", "local"]
    assert d2.attempts[-1] == 1


async def test_prefill_failures_spend_none_of_the_decodes_retries(
    servers: list[Receiver],
) -> None:
    p = await start(servers, "p", "prefill")
    d1, d2 = await start(servers, "d1", "decode"), await start(servers, "d2", "decode")
    p.answer_status = d1.answer_status = 503
    for _ in range(6):  # one retry (retries=1): the prefill's failure is not the decode's
        result, stats = await hop_once(Pools(p.replica(), d1.replica(), d2.replica()))
        assert result.error is None and result.outputs[2].fields == {"by": "d2", "kv": ""}
        assert stats.kv_handoffs == ["local"]
        if d1.got:
            break
    assert d1.got and d1.attempts[0] == 0  # the decode's own first attempt


async def test_an_unsplit_pool_has_no_kv_handoff(servers: list[Receiver]) -> None:
    a = await start(servers, "a", "")
    result, stats = await hop_once(Pools(a.replica()))
    assert result.outputs[2].fields == {"by": "a", "kv": ""}
    assert stats.kv_handoffs == [] and a.got == [""]


TOKENS = Payload(tensors={"token_ids": tensor_from_array(np.arange(300, dtype=np.int64))})


async def _prefill_held(
    servers: list[Receiver],
) -> tuple[Receiver, Router, asyncio.Task[tuple[HopResult, HopStats]]]:
    """A hop whose prefill (of :data:`TOKENS`) waits on the prefill replica "p": the
    replica, the hop's router, and the hop's task."""
    p, d = await start(servers, "p", "prefill"), await start(servers, "d", "decode")
    p.hold = asyncio.Event()
    pools = Pools(p.replica(), d.replica())
    router = Router(pools, host_id="host-a", rng=random.Random(1))
    task = asyncio.create_task(hop_once(pools, router=router, payload=TOKENS))
    await asyncio.wait_for(p.arrived.wait(), 5)
    assert (router.prefill_tokens("p"), router.in_flight("p")) == (300, 1)
    return p, router, task


async def test_a_prefills_prompt_tokens_count_on_its_replica_until_it_answers(
    servers: list[Receiver],
) -> None:
    p, router, task = await _prefill_held(servers)
    assert p.hold is not None
    p.hold.set()
    result, stats = await asyncio.wait_for(task, 5)
    assert result.error is None and stats.kv_handoffs == ["remote"]
    assert (router.prefill_tokens("p"), router.in_flight("p")) == (0, 0)
    assert router.prefill_tokens("d") == 0  # the decode carries no prefill tokens


async def test_a_failed_prefill_takes_its_tokens_off_its_replica(
    servers: list[Receiver],
) -> None:
    p, router, task = await _prefill_held(servers)
    assert p.hold is not None
    p.answer_status = 503
    p.hold.set()
    result, stats = await asyncio.wait_for(task, 5)
    assert result.error is None and stats.kv_handoffs == ["local"]
    assert (router.prefill_tokens("p"), router.in_flight("p")) == (0, 0)


async def test_a_cancelled_prefill_takes_its_tokens_off_its_replica(
    servers: list[Receiver],
) -> None:
    p, router, task = await _prefill_held(servers)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (router.prefill_tokens("p"), router.in_flight("p")) == (0, 0)
    assert p.hold is not None
    p.hold.set()  # the receiver's handler ends (its server's cleanup waits for it)


def test_decode_params_refuse_what_is_not_a_prefill_answer() -> None:
    params = decode_params(PARAMS)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "engine-p"
    for bad, why in (("{", "not JSON"), ("[1]", "no remote_engine_id"), ("{}", "no remote")):
        with pytest.raises(KvTransferError, match=why):
            decode_params(bad)
    with pytest.raises(KvTransferError, match="longer than"):
        decode_params("x" * (1 << 21))
