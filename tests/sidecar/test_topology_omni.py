"""tiny-omni at 1:2:1 as real processes: the OpenAI SDK as client, the orchestrated path and the
/v1/run loop giving identical bytes, every replica getting work, bad /v1/run input → 400, and a
middle replica killed under load without losing a request (and the replayed requests giving the
bytes they gave before the kill)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Prompt
from omni_mesh.run_client.client import FixedUrls, RunClient
from tests.sidecar.topology import Topology, post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    before = shm_segments()
    topo = Topology("tiny-omni", [1, 2, 1], tmp_path_factory.mktemp("omni")).start()
    try:
        topo.wait_discovered(1, 2)
        yield topo
    finally:
        topo.close()
    assert shm_segments() - before == set(), "shared-memory segments leaked"


def _client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.api_url + "/v1", api_key="unused", max_retries=0)


def _wav(data: bytes) -> tuple[int, int]:
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate(), w.getnframes()


def test_openai_speech_and_chat(omni: Topology) -> None:
    client = _client(omni)
    assert [m.id for m in client.models.list().data] == ["tiny-omni"]
    speech = client.audio.speech.create(model="tiny-omni", input="Hello there", voice="alloy")
    rate, frames = _wav(speech.content)
    assert rate == 24000 and frames > 0 and frames % 1920 == 0
    chat = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "Say something."}],
        modalities=["text", "audio"],
        audio={"voice": "nova", "format": "wav"},
        seed=11,
    )
    message = chat.choices[0].message
    assert message.content
    assert message.audio is not None
    assert _wav(base64.b64decode(message.audio.data))[0] == 24000
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.audio.speech.create(model="other", input="x", voice="alloy")


def test_same_seed_same_bytes_orchestrated_and_run_loop(omni: Topology) -> None:
    prompt = {"prompt": "Determinism across paths.", "seed": 1234, "voice": "echo"}
    status, body = post_json(omni.api_url + "/v1/generate", prompt)
    assert status == 200, body
    outputs = json.loads(body)["outputs"]
    assert outputs["0"]["kind"] == "text" and outputs["2"]["kind"] == "audio"

    async def loop() -> dict[int, object]:
        async with RunClient(get_pipeline("tiny-omni"), FixedUrls([omni.api_url])) as rc:
            trace = await rc.run(Prompt(**prompt))  # type: ignore[arg-type]
        return dict(trace.outputs)

    run_outputs = asyncio.run(loop())
    assert run_outputs[0].text == outputs["0"]["text"]  # type: ignore[attr-defined]
    assert run_outputs[2].data == base64.b64decode(outputs["2"]["data"])  # type: ignore[attr-defined]


def test_every_replica_gets_work(omni: Topology) -> None:
    def one(i: int) -> int:
        return post_json(omni.api_url + "/v1/generate", {"prompt": f"load {i}", "seed": i})[0]

    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(one, range(12))) == {200}
    for url in omni.urls[1]:
        assert omni.metric(url, "omni_stage_requests_total", route="hop", outcome="ok") > 0, url
    api = omni.metric(omni.api_url, "omni_api_requests_total", route="/v1/generate", status="200")
    assert api >= 12


def _run(url: str, body: object) -> tuple[int, dict[str, object]]:
    status, raw = post_json(url + "/v1/run", body)
    return status, json.loads(raw)


def test_bad_run_inputs_are_400(omni: Topology) -> None:
    api = omni.api_url
    status, first = _run(api, {"stage_id": 0, "stage_input": {"prompt": "hi", "seed": 5}})
    assert status == 200, first
    good = str(first["stage_input"])
    raw = bytearray(base64.urlsafe_b64decode(good + "=" * (-len(good) % 4)))
    flipped = bytes(raw[:20]) + bytes([raw[20] ^ 1]) + bytes(raw[21:])
    version = bytes(raw[:4]) + b"\x09" + bytes(raw[5:])
    cases: list[tuple[object, str]] = [
        ({"stage_id": 9, "stage_input": good}, "has no stage 9"),
        ({"stage_id": 2, "stage_input": good}, "stage 1"),  # wrong receiver
        ({"stage_id": 1, "stage_input": base64.urlsafe_b64encode(flipped).decode()}, "tag"),
        ({"stage_id": 1, "stage_input": base64.urlsafe_b64encode(version).decode()}, "version"),
        ({"stage_id": 1, "stage_input": "!!!not base64!!!"}, "base64"),
        ({"stage_id": 1, "stage_input": {"prompt": "x"}}, "opaque"),
        ({"stage_id": 0, "stage_input": good}, "prompt object"),
        ({"stage_id": 0, "stage_input": {"prompt": "x", "size": 64}}, "size"),
        ({"stage_id": 0, "stage_input": {"prompt": "x", "bogus": 1}}, "bogus"),
        ({"stage_id": "one", "stage_input": good}, "stage_id"),
    ]
    for body, needle in cases:
        status, err = _run(api, body)
        assert status == 400, (body if len(str(body)) < 300 else "big", err)
        assert needle in json.dumps(err), (needle, err)
    # Headless replicas accept only their own stage.
    status, err = _run(omni.urls[2][0], {"stage_id": 1, "stage_input": good})
    assert status == 400 and "runs stage 2 only" in json.dumps(err)
    # And nothing broke: the good input still runs.
    assert _run(api, {"stage_id": 1, "stage_input": good})[0] == 200


def _audio(topo: Topology, prompt: str, seed: int) -> bytes:
    status, body = post_json(
        topo.api_url + "/v1/generate", {"prompt": prompt, "seed": seed, "voice": "onyx"}
    )
    assert status == 200, body
    return bytes(json.loads(body)["outputs"]["2"]["data"], "ascii")


def test_kill_middle_replica_under_load_loses_nothing_and_replays_identical_bytes(
    omni: Topology,
) -> None:
    """A middle replica killed with -9 (the sidecar only: its engine cleans up) while it holds
    a request: all 16 requests are answered, each with the bytes its seed gave before the kill
    (the hops the victim held are replayed on the survivor), and the victim leaves discovery."""
    victim, victim_url, survivor = omni.stages[1][0], omni.urls[1][0], omni.urls[1][1]
    hops_before = omni.metric(survivor, "omni_stage_requests_total", route="hop")
    sender = omni.urls[0][0]
    retries_before = omni.metric(sender, "omni_stage_hop_retries_total", to_stage="1")
    reference = {seed: _audio(omni, f"replay {seed}", seed) for seed in range(4)}
    with ThreadPoolExecutor(4) as pool:
        futures = {i: pool.submit(_audio, omni, f"replay {i % 4}", i % 4) for i in range(16)}
        # Kill it while it holds work (a fixed sleep raced a loaded machine: with nothing in
        # flight at the kill, no hop fails and nothing is replayed).
        until = time.monotonic() + 30
        while omni.metric(victim_url, "omni_stage_in_flight") < 1:
            assert time.monotonic() < until, "the victim never held a request"
            time.sleep(0.02)
        os.kill(victim.pid, signal.SIGKILL)
        for i, fut in futures.items():
            assert fut.result(timeout=120) == reference[i % 4], i
    # The survivor took the replays, and there were replays: hops to the dead replica failed
    # and were sent again.
    assert omni.metric(survivor, "omni_stage_requests_total", route="hop") - hops_before >= 8
    assert omni.metric(sender, "omni_stage_hop_retries_total", to_stage="1") > retries_before
    omni.wait_discovered(1, 1, timeout=6.0)
