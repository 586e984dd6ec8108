"""What synthetic-diamond's join stage s3 answers, computed here from the synthetic engine's
definition, and that answer as the API gives it: shared by the join tests."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from omni_mesh.engines.synthetic import synthetic_bytes
from tests.sidecar.topology import post_json

PIPELINE = "synthetic-diamond"
OUTPUT_BYTES = {1: 64, 2: 96, 3: 64}  # configs/deploy/synthetic-diamond.yaml


@dataclass(frozen=True)
class JoinAnswer:
    data: bytes  # s3's own output
    sources: str  # the join's sources, as s3 saw them in its input
    sha256: str  # over s3's input arrays, in name order


def source_bytes(stage_id: int, seed: int) -> bytes:
    return synthetic_bytes(seed, f"{PIPELINE}/{stage_id}", OUTPUT_BYTES[stage_id]).tobytes()


def expected_s3(seed: int) -> JoinAnswer:
    digest = hashlib.sha256()
    for name, stage_id in (("s1.data", 1), ("s2.data", 2)):
        digest.update(name.encode() + b"\0" + source_bytes(stage_id, seed))
    return JoinAnswer(source_bytes(3, seed), "s1,s2", digest.hexdigest())


def from_output(output: dict[str, Any]) -> JoinAnswer:
    fields = output.get("fields", {})
    data = base64.b64decode(output["data"])
    return JoinAnswer(data, fields.get("join_sources", ""), fields.get("join_sha256", ""))


def generate(api_url: str, seed: int, prompt: str = "diamond") -> JoinAnswer:
    status, body = post_json(api_url + "/v1/generate", {"prompt": prompt, "seed": seed})
    assert status == 200, body
    outputs = json.loads(body)["outputs"]
    assert sorted(outputs) == ["3"], outputs
    return from_output(outputs["3"])
