"""glm-image through ``omni-up`` at 1:2 (one AR, two DiT replicas), asked with the official
``openai`` SDK's ``images.generate``: every PNG's pixels equal diffusers' monolithic
``GlmImagePipeline.__call__`` with a generator of the request's seed (the DiT's steps and
guidance as the deploy file sets them); both DiT replicas take hops; ``/v1/run`` stage by stage
gives the same pixels through a hand-off of under a kilobyte; nothing is left in /dev/shm."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import openai
import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.engines.glm_image import glm_reference
from tests.procs import orphaned_shm_segments
from tests.procs.omni_up import omni_up, stage_pools
from tests.sidecar.topology import http_get, post_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SECRET = "glm-image-test-secret-0123456789"
STEPS, GUIDANCE = 8, 1.5  # the bundled deploy file's DiT settings


def test_images_through_omni_up_1_2_equal_the_pipeline(tmp_path: Path) -> None:
    deploy = tmp_path / "glm-image.yaml"
    bundled = bundled_deploy_path("glm-image").read_text()
    assert f"steps: {STEPS}, guidance_scale: {GUIDANCE}" in bundled
    deploy.write_text(bundled.replace("num_replicas: 1         # a 1:N", "num_replicas: 2  # 1:N"))
    before = orphaned_shm_segments()
    pipe = glm_reference.monolithic()
    prompts = [(3, "a red 'STOP' sign"), (4, "a green field"), (5, "a blue car"), (3, "a cat")]
    with omni_up("glm-image", deploy, tmp_path, secret=SECRET) as (proc, url):
        assert len(stage_pools(proc.stdout, 1, "dit")[""]) == 2  # 1:2
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        for seed, prompt in prompts:
            answer = client.images.generate(prompt=prompt, size="64x64", extra_body={"seed": seed})
            (image,) = answer.data
            assert image.b64_json is not None
            got = glm_reference.png_pixels(base64.b64decode(image.b64_json))
            want = glm_reference.pipeline_pixels(pipe, prompt, seed, 64, 64, STEPS, GUIDANCE)
            assert np.array_equal(got, want), (seed, prompt)
        # both DiT replicas take hops (the AR's router learns of the second from its own
        # discovery refresh, a moment after omni-cp lists it, so a few more may be needed)
        dits = stage_pools(proc.stdout, 1, "dit")[""]
        for i in range(24):
            if all(_hops(dit) > 0 for dit in dits):
                break
            client.images.generate(prompt=f"one more {i}", size="32x32")
        assert all(_hops(dit) > 0 for dit in dits), [_hops(dit) for dit in dits]
        # /v1/run stage by stage: the AR's opaque hand-off (token ids, prompt, size; the seed),
        # then the DiT's image, the same pixels
        seed, prompt = 6, "a lamp 'ON'"
        want = glm_reference.pipeline_pixels(pipe, prompt, seed, 64, 64, STEPS, GUIDANCE)
        first = {"stage_id": 0, "stage_input": {"prompt": prompt, "seed": seed, "size": 64}}
        status, body = post_json(url + "/v1/run", first)
        assert status == 200, body
        hop = json.loads(body)
        assert hop["next_stage_id"] == 1 and len(hop["stage_input"]) < 1024
        status, body = post_json(
            url + "/v1/run", {"stage_id": 1, "stage_input": hop["stage_input"]}
        )
        assert status == 200, body
        output = json.loads(body)["output"]
        assert output["kind"] == "image" and output["mime_type"] == "image/png"
        assert np.array_equal(glm_reference.png_pixels(base64.b64decode(output["data"])), want)
        with pytest.raises(openai.BadRequestError, match="size"):
            client.images.generate(prompt="x", size="48x48", extra_body={"seed": 1})
    time.sleep(0.2)
    assert orphaned_shm_segments() - before == set(), "shared-memory segments leaked"


def _hops(url: str) -> float:
    """The hops a pod has taken (its ``omni_stage_requests_total{route="hop"}``)."""
    total = 0.0
    for line in http_get(url + "/metrics").decode().splitlines():
        if line.startswith("omni_stage_requests_total") and 'route="hop"' in line:
            total += float(line.rpartition(" ")[2])
    return total
