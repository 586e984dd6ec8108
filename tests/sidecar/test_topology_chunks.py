"""async_chunk across real processes, on the synthetic pipeline: a stage that emits its output in
chunks hands each chunk to the next stage as it comes (spread over the next stage's replicas),
the chunks' results stream back up the chain, and a streaming replica killed mid-stream is
replayed without a chunk lost or delivered twice."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import omni_mesh
from tests.procs import wait_until
from tests.sidecar.topology import Topology, engine_pid, post_json, shm_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BUNDLED = Path(omni_mesh.__file__).parent / "configs" / "deploy" / "synthetic.yaml"
CHUNKS = 6


def chunked_config(tmp_path: Path, *, step_latency_ms: float) -> Path:
    path = tmp_path / "synthetic-chunks.yaml"
    path.write_text(
        f"base_config: {BUNDLED}\n"
        "async_chunk: true\n"
        "stages:\n"
        "  - stage_id: 0\n"
        f"    output_chunks: {CHUNKS}\n"
        f"    step_latency_ms: {step_latency_ms}\n"
        "    output_bytes: 6000\n"
    )
    return path


@pytest.fixture
def no_shm_leak() -> Iterator[None]:
    before = shm_segments()
    yield
    wait_until(lambda: not (shm_segments() - before), 5.0, message=lambda: "shm leaked")


def generate(topo: Topology, seed: int) -> bytes:
    status, body = post_json(topo.api_url + "/v1/generate", {"prompt": f"p{seed}", "seed": seed})
    assert status == 200, body
    return base64.b64decode(json.loads(body)["outputs"]["2"]["data"])


def test_chunks_flow_through_every_stage(tmp_path: Path, no_shm_leak: None) -> None:
    config = chunked_config(tmp_path, step_latency_ms=0)
    topo = Topology(
        "synthetic", [1, 2, 1], tmp_path, extra_stage_args=["--deploy-config", str(config)]
    ).start()
    try:
        topo.wait_discovered(1, 2)
        n = 6
        outputs = [generate(topo, seed) for seed in range(n)]
        # The last stage ran once per chunk: its output is the chunks' outputs joined.
        s2_bytes = 64  # the bundled config's output_bytes for stage 2
        assert all(len(out) == CHUNKS * s2_bytes for out in outputs)
        assert outputs[0] == generate(topo, 0)  # deterministic for the seed
        s0 = topo.urls[0][0]
        assert topo.metric(s0, "omni_stage_output_chunks_total") == CHUNKS * (n + 1)
        assert topo.metric(s0, "omni_stage_hop_frames_total") > 0  # s0 streamed its answers
        per_replica = [
            topo.metric(u, "omni_stage_requests_total", route="hop") for u in topo.urls[1]
        ]
        assert sum(per_replica) == CHUNKS * (n + 1)
        assert all(count > 0 for count in per_replica), per_replica  # chunks spread out
        s2 = topo.urls[2][0]
        assert topo.metric(s2, "omni_stage_requests_total", route="hop", outcome="ok") == (
            CHUNKS * (n + 1)
        )
        # One output per chunk it got: chunks too, though its engine does not stream itself.
        assert topo.metric(s2, "omni_stage_output_chunks_total") == CHUNKS * (n + 1)
    finally:
        topo.close()


@pytest.mark.parametrize("victim_process", ["sidecar", "engine"])
def test_a_streaming_replica_killed_mid_stream_is_replayed(
    tmp_path: Path, no_shm_leak: None, victim_process: str
) -> None:
    """Whether the pod dies or only its engine (the pod then cuts its streamed answer and
    exits), the API server replays the stream on the other replica."""
    config = chunked_config(tmp_path, step_latency_ms=150)  # ~0.9 s per request on stage 0
    topo = Topology(
        "synthetic", [2, 1, 1], tmp_path, extra_stage_args=["--deploy-config", str(config)]
    ).start()
    try:
        topo.wait_discovered(0, 2)
        reference = generate(topo, 42)
        got: dict[str, bytes] = {}

        def client() -> None:
            got["out"] = generate(topo, 42)

        def streaming() -> int | None:
            """The stage-0 replica that is mid-way through the request's chunks."""
            for i, url in enumerate(topo.urls[0]):
                in_flight = topo.metric(url, "omni_stage_in_flight")
                chunks = topo.metric(url, "omni_stage_output_chunks_total")
                if in_flight >= 1 and chunks % CHUNKS >= 2:
                    return i
            return None

        thread = threading.Thread(target=client)
        thread.start()
        victim: list[int] = []
        wait_until(lambda: (i := streaming()) is not None and not victim.append(i), 10.0)
        pod = topo.stages[0][victim[0]]
        os.kill(pod.pid if victim_process == "sidecar" else engine_pid(pod), signal.SIGKILL)
        thread.join(timeout=120)
        assert got["out"] == reference  # no chunk lost, none twice, same bytes
        survivor = topo.urls[0][1 - victim[0]]
        assert topo.metric(survivor, "omni_stage_output_chunks_total") >= CHUNKS
        assert topo.metric(topo.api_url, "omni_stage_hop_retries_total", to_stage="0") >= 1
    finally:
        topo.close()
