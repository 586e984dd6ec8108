"""The peer benchmark's Ray Serve side: the synthetic pipeline as a Ray Serve deployment graph.

Runs under ``benchmarks/.ray-venv/bin/python`` (``ray[serve]`` lives there, not in the
project), imports nothing of omni-mesh. Two applications behind Ray's HTTP proxy on
127.0.0.1:PORT, each an HTTP ingress deployment that chains three stage deployments by
handle (``s2.remote(s1.remote(s0.remote(x)))``: Ray passes the intermediate results as object
references, so they do not travel through the ingress):

* ``/noop``: three no-op stages (plain async methods, 64-byte output) — no batching, Ray's
  lowest-latency configuration;
* ``/synthetic``: three stages with omni-mesh's synthetic latency model, batched with
  ``@serve.batch(max_batch_size=8, batch_wait_timeout_s=0)`` like omni-mesh's engine loop
  (``max_num_seqs`` 8): each batch sleeps ``a + b·batch`` ms (less the time spent making the
  outputs) and every request outputs ``out`` bytes made the same way as omni-mesh's
  ``synthetic_bytes``.

Prints ``RAY-READY`` when both answer, then serves until SIGTERM/SIGINT, when it shuts Serve and
Ray down.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import signal
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

BLOCK_BYTES = 4096
# (step_latency_ms a, per_item_latency_ms b, output_bytes): the deploy-config example in
# omni_mesh/configs/deploy/synthetic.yaml, the same figures the omni-mesh side runs.
SYNTHETIC = ((25.0, 1.5, 4 * 1024 * 1024), (12.0, 0.5, 256 * 1024), (5.0, 0.2, 96000))
MAX_ONGOING = 256


def synthetic_bytes(seed: int, salt: str, nbytes: int) -> np.ndarray:
    if nbytes <= 0:
        return np.empty(0, dtype=np.uint8)
    key = hashlib.sha256(f"{salt}\x1f{seed}".encode()).digest()
    block = np.random.default_rng(np.frombuffer(key, dtype=np.uint32)).integers(
        0, 256, size=min(nbytes, BLOCK_BYTES), dtype=np.uint8
    )
    return np.resize(block, nbytes)


@serve.deployment(max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0})
class NoopStage:
    def __init__(self, name: str) -> None:
        self.salt = f"synthetic/{name}"

    async def __call__(self, x: dict[str, Any]) -> dict[str, Any]:
        return {
            "prompt": x["prompt"],
            "seed": x["seed"],
            "data": synthetic_bytes(x["seed"], self.salt, 64),
        }


@serve.deployment(max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0})
class SynthStage:
    def __init__(self, name: str, a_ms: float, b_ms: float, out: int) -> None:
        self.salt = f"synthetic/{name}"
        self.a_ms, self.b_ms, self.out = a_ms, b_ms, out

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)
    async def step(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        started = time.perf_counter()
        outs = [
            {
                "prompt": x["prompt"],
                "seed": x["seed"],
                "data": synthetic_bytes(x["seed"], self.salt, self.out),
            }
            for x in batch
        ]
        remaining = (self.a_ms + self.b_ms * len(batch)) / 1e3 - (time.perf_counter() - started)
        if remaining > 0:
            await asyncio.sleep(remaining)
        return outs

    async def __call__(self, x: dict[str, Any]) -> dict[str, Any]:
        return await self.step(x)


@serve.deployment(max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0})
class Ingress:
    def __init__(self, s0: Any, s1: Any, s2: Any) -> None:
        self.s0, self.s1, self.s2 = s0, s1, s2

    async def __call__(self, request: Request) -> JSONResponse:
        body = await request.json()
        x = {"prompt": str(body["prompt"]), "seed": int(body.get("seed", 0))}
        out = await self.s2.remote(self.s1.remote(self.s0.remote(x)))
        data = base64.b64encode(np.ascontiguousarray(out["data"]).tobytes()).decode()
        return JSONResponse(
            {"pipeline": "synthetic", "outputs": {"2": {"kind": "data", "data": data}}}
        )


def build_noop() -> Any:
    stages = [NoopStage.options(name=f"noop_s{i}").bind(f"s{i}") for i in range(3)]
    return Ingress.options(name="noop_ingress").bind(*stages)


def build_synthetic() -> Any:
    stages = [
        SynthStage.options(name=f"syn_s{i}").bind(f"s{i}", a, b, out)
        for i, (a, b, out) in enumerate(SYNTHETIC)
    ]
    return Ingress.options(name="syn_ingress").bind(*stages)


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(
            url, data=b'{"prompt": "x", "seed": 1}', headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not answering after {timeout} s")
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--temp-dir", required=True)
    args = p.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=args.temp_dir,
        object_store_memory=1 << 30,
        logging_level="ERROR",
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_noop(), name="noop", route_prefix="/noop")
        serve.run(build_synthetic(), name="synthetic", route_prefix="/synthetic")
        base = f"http://127.0.0.1:{args.port}"
        _wait_http(base + "/noop", 120)
        _wait_http(base + "/synthetic", 120)
        print("RAY-READY", flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
