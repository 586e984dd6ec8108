"""What every benchmark shares: its options, its report, the hop request builders."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.fabric import SECRET
from benchmarks.load import RequestFn, expect_ok
from benchmarks.measure import Target, md_table
from omni_mesh.data_plane import codec
from omni_mesh.data_plane.messages import HopResult, Payload, StageInput, Tensor
from omni_mesh.data_plane.signing import hop_token
from omni_mesh.sidecar.hop.client import HOP_TOKEN_HEADER

MSGPACK_HEADERS = {"Content-Type": "application/msgpack"}
#: What a sidecar sends with every hop: the deployment's hop token (HMAC of the secret).
HOP_HEADERS = {**MSGPACK_HEADERS, HOP_TOKEN_HEADER: hop_token(SECRET.encode())}
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Options:
    quick: bool = False
    reps: int | None = None  # override the number of repetitions
    profile_dir: Path | None = None  # py-spy profiles of the fabric under load

    def pick(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def pickf(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def repetitions(self, full: int = 5, quick: int = 3) -> int:
        return self.reps or (quick if self.quick else full)


@dataclass
class Report:
    name: str
    title: str
    sections: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, text: str) -> None:
        self.sections.append(text)
        print(text, flush=True)

    def markdown(self) -> str:
        out = [f"### {self.title}", ""]
        out += [s.rstrip() + "\n" for s in self.sections]
        if self.targets:
            out.append(
                md_table(
                    ["target", "measured", "bound", "verdict"],
                    [t.row() for t in self.targets],
                    title="Targets",
                )
            )
        if self.notes:
            out.append("Notes:\n")
            out += [f"- {n}" for n in self.notes]
            out.append("")
        out.append(f"_({self.name} took {self.seconds:.0f} s)_\n")
        return "\n".join(out)


# ---- /v1/hop requests ----------------------------------------------------------------------


def hop_input(
    stage_id: int, request_id: str, seed: int, *, timeout_s: float = 60.0, data_bytes: int = 64
) -> StageInput:
    """A ``StageInput`` for ``stage_id`` of the synthetic pipeline, shaped like the one the
    previous stage's engine would emit (its fields, plus its ``data`` array after stage 0)."""
    tensors: dict[str, Tensor] = {}
    if stage_id > 0 and data_bytes:
        raw = np.full(data_bytes, seed % 251, dtype=np.uint8).tobytes()
        tensors["data"] = Tensor(dtype="uint8", shape=(data_bytes,), data=memoryview(raw))
    return StageInput(
        pipeline="synthetic",
        request_id=request_id,
        stage_id=stage_id,
        from_stage=stage_id - 1,
        deadline_ms=int((time.time() + timeout_s) * 1000),
        seed=seed,
        payload=Payload(fields={"prompt": "x"}, tensors=tensors),
    )


def hop_caller(
    url: str, stage_id: int, tag: str, *, on_result: Callable[[HopResult], None] | None = None
) -> RequestFn:
    """A load-generator request that runs the chain from ``stage_id`` via its ``/v1/hop``."""
    target = url + "/v1/hop"

    async def call(sess: aiohttp.ClientSession, i: int) -> None:
        body = codec.encode(hop_input(stage_id, f"{tag}-{i}", i))
        async with sess.post(target, data=body, headers=HOP_HEADERS) as resp:
            data = await expect_ok(resp)
        result = codec.decode(data, HopResult)
        if result.error is not None:
            raise RuntimeError(f"{result.error.code}: {result.error.message[:200]}")
        if on_result is not None:
            on_result(result)

    return call


def generate_caller(url: str) -> RequestFn:
    """A load-generator request to an API server's ``POST /v1/generate``."""
    target = url + "/v1/generate"

    async def call(sess: aiohttp.ClientSession, i: int) -> None:
        async with sess.post(target, json={"prompt": "x", "seed": i}) as resp:
            await expect_ok(resp)

    return call


def post_caller(url: str, body: bytes) -> RequestFn:
    async def call(sess: aiohttp.ClientSession, i: int) -> None:
        async with sess.post(url, data=body, headers=MSGPACK_HEADERS) as resp:
            await expect_ok(resp)

    return call
