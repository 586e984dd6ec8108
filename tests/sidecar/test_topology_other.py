"""tiny-tts and tiny-image at 1:2, stages started in any order (bounded wait, then 503),
engine death leaving the pool, SIGTERM drain (on one tiny-tts, one scenario after the other) —
and nothing left behind."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests import media_readers
from tests.procs import pid_alive
from tests.sidecar.topology import (
    Topology,
    engine_pid,
    engine_tmp,
    post_json,
    shm_segments,
    wait_gone,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def no_shm_leak() -> Iterator[None]:
    before = shm_segments()
    yield
    time.sleep(0.2)
    assert shm_segments() - before == set(), "shared-memory segments leaked"


def test_tiny_image_1_2(tmp_path: Path, no_shm_leak: None) -> None:
    topo = Topology("tiny-image", [1, 2], tmp_path).start()
    try:
        topo.wait_discovered(1, 2)
        client = openai.OpenAI(base_url=topo.api_url + "/v1", api_key="x", max_retries=0)
        images = [
            client.images.generate(prompt=f"a tiny picture {i}", size="64x64").data[0]
            for i in range(6)
        ]
        for image in images:
            assert image.b64_json is not None
            assert media_readers.read_png_size(base64.b64decode(image.b64_json)) == (64, 64)

        # Both replicas take hops: stage 0's router learns of the second one from its own
        # discovery refresh, a moment after omni-cp lists it, so a few more may be needed.
        def hops(url: str) -> float:
            return topo.metric(url, "omni_stage_requests_total", route="hop")

        for i in range(24):
            if all(hops(url) > 0 for url in topo.urls[1]):
                break
            client.images.generate(prompt=f"one more {i}", size="64x64")
        assert all(hops(url) > 0 for url in topo.urls[1]), [hops(u) for u in topo.urls[1]]
        # streamed: the image alone (its DiT sends no previews); square sizes only, and no
        # partial images from a pipeline that does not make them: 400s naming the field
        (done,) = list(client.images.generate(prompt="streamed", size="32x32", stream=True))
        assert done.type == "image_generation.completed" and done.size == "32x32"
        assert media_readers.read_png_size(base64.b64decode(done.b64_json)) == (32, 32)
        for kwargs, field in [
            ({"size": "64x32"}, "size"),
            ({"stream": True, "partial_images": 2}, "partial_images"),
            ({"extra_body": {"guidance_scale": 2.0}}, "guidance_scale"),
        ]:
            with pytest.raises(openai.BadRequestError) as caught:
                client.images.generate(prompt="x", **kwargs)
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == field
    finally:
        topo.close()


def _started_in_any_order(topo: Topology) -> None:
    """The API server and stage 0 are up, stage 1 does not exist yet: a bounded wait, then
    503 naming it; once two stage-1 replicas come up, the same request is answered."""
    req = {"model": "tiny-tts", "input": "order", "voice": "alloy"}
    t0 = time.monotonic()
    status, body = _post(topo.api_url + "/v1/audio/speech", req, timeout_s=1.5)
    waited = time.monotonic() - t0
    assert status == 503, body
    assert "stage 1" in body.decode()
    assert 1.0 <= waited < 30.0
    for _ in range(2):
        topo.add_replica(1)
    topo.wait_discovered(1, 2)
    status, body = _post(topo.api_url + "/v1/audio/speech", req, timeout_s=60)
    assert status == 200, body
    assert media_readers.read_wav(body)[1] == 24000


def _post(url: str, body: object, *, timeout_s: float) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Omni-Timeout-S": str(timeout_s)},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s + 30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _engine_death_and_sigterm_drain(topo: Topology) -> None:
    """Of the two stage-1 replicas, one loses its engine (kill -9) and leaves the pool; the
    other gets SIGTERM and drains; stage 0 still answers."""
    topo.wait_discovered(1, 2)
    dying, draining = topo.stages[1]
    # kill -9 of an engine: its sidecar notices within a second, leaves, exits non-zero, and
    # removes the engine's own temp folder with what the engine left in it.
    pid = engine_pid(dying)
    dying_tmp = engine_tmp(pid)
    (dying_tmp / "vllm_dist_leftover").write_text("x")
    os.kill(pid, signal.SIGKILL)
    assert dying.wait(timeout=5) != 0
    assert not dying_tmp.exists()
    topo.wait_discovered(1, 1, timeout=4.0)
    # SIGTERM: leave the pool first, then exit 0 with the engine gone (and its temp folder).
    engine = engine_pid(draining)
    draining_tmp = engine_tmp(engine)
    draining.send_signal(signal.SIGTERM)
    assert draining.wait(timeout=30) == 0
    wait_gone(engine, 10)
    assert not pid_alive(engine)
    assert not draining_tmp.exists()
    assert topo.discovered(1) == []
    # The rest of the pipeline is fine: stage 0 answers /v1/run.
    status, _ = post_json(
        topo.urls[0][0] + "/v1/run", {"stage_id": 0, "stage_input": {"prompt": "x"}}
    )
    assert status == 200


def test_tiny_tts_started_in_any_order_then_engine_death_and_sigterm_drain(
    tmp_path: Path, no_shm_leak: None
) -> None:
    """One tiny-tts 1:2 (its start-up is most of the cost) for two scenarios in turn: stages
    started in any order, then engine death leaving the pool and a SIGTERM drain."""
    topo = Topology("tiny-tts", [1, 2], tmp_path).start(stages=[0])
    try:
        _started_in_any_order(topo)
        _engine_death_and_sigterm_drain(topo)
    finally:
        topo.close()
