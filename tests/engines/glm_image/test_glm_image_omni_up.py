"""glm-image through ``omni-up`` at 1:2 (one AR, two DiT replicas), asked with the official
``openai`` SDK's ``images.generate``: every PNG's pixels equal diffusers' monolithic
``GlmImagePipeline.__call__`` with a generator of the request's seed (the DiT's steps and
guidance as the deploy file sets them, or as a request's ``extra_body`` does; non-square sizes,
``n`` images seeded ``seed + i``); bad sizes, counts and formats are 400s naming the field;
streamed with ``partial_images`` the previews come first and the completed image is still the
pipeline's; both DiT replicas take hops; ``/v1/run`` stage by stage
gives the same pixels through a hand-off of under a kilobyte; a DiT replica killed (kill -9 of
its engine) mid-denoise costs nothing but time: the hop is replayed on the other replica and the
image is the same; nothing is left in /dev/shm."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.engines.glm_image import glm_reference
from tests.procs import orphaned_shm_segments, wait_until
from tests.procs.managed import ManagedProcess
from tests.procs.omni_up import omni_up, stage_pools
from tests.sidecar.topology import http_get, post_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SECRET = "glm-image-test-secret-0123456789"
STEPS, GUIDANCE = 8, 1.5  # the bundled deploy file's DiT settings


@dataclass
class Deployment:
    proc: ManagedProcess
    url: str
    pipe: Any  # the monolithic GlmImagePipeline

    @property
    def dits(self) -> list[str]:
        return stage_pools(self.proc.stdout, 1, "dit")[""]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("glm-image-up")
    deploy = tmp / "glm-image.yaml"
    bundled = bundled_deploy_path("glm-image").read_text()
    assert f"steps: {STEPS}, guidance_scale: {GUIDANCE}" in bundled
    deploy.write_text(bundled.replace("num_replicas: 1         # a 1:N", "num_replicas: 2  # 1:N"))
    before = orphaned_shm_segments()
    pipe = glm_reference.monolithic()
    with omni_up("glm-image", deploy, tmp, secret=SECRET) as (proc, url):
        yield Deployment(proc, url, pipe)
    time.sleep(0.2)
    assert orphaned_shm_segments() - before == set(), "shared-memory segments leaked"


def test_images_through_omni_up_1_2_equal_the_pipeline(deployment: Deployment) -> None:
    pipe, url = deployment.pipe, deployment.url
    assert len(deployment.dits) == 2  # 1:2
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    prompts = [(3, "a red 'STOP' sign"), (4, "a green field"), (5, "a blue car"), (3, "a cat")]
    for seed, prompt in prompts:
        answer = client.images.generate(prompt=prompt, size="64x64", extra_body={"seed": seed})
        (image,) = answer.data
        assert image.b64_json is not None
        got = glm_reference.png_pixels(base64.b64decode(image.b64_json))
        want = glm_reference.pipeline_pixels(pipe, prompt, seed, 64, 64, STEPS, GUIDANCE)
        assert np.array_equal(got, want), (seed, prompt)
    # both DiT replicas take hops (the AR's router learns of the second from its own
    # discovery refresh, a moment after omni-cp lists it, so a few more may be needed)
    for i in range(24):
        if all(_hops(dit) > 0 for dit in deployment.dits):
            break
        client.images.generate(prompt=f"one more {i}", size="32x32")
    assert all(_hops(dit) > 0 for dit in deployment.dits), [_hops(d) for d in deployment.dits]
    with pytest.raises(openai.BadRequestError, match="size"):
        client.images.generate(prompt="x", size="48x48", extra_body={"seed": 1})


def test_the_images_route_takes_sizes_counts_and_extensions(deployment: Deployment) -> None:
    """A non-square size, ``n`` images seeded ``seed + i``, ``steps`` and ``guidance_scale``
    (``extra_body``): each PNG is the pipeline's for its seed. Bad sizes, counts and formats:
    a 400 naming the field."""
    client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="x", max_retries=0, timeout=120)
    seed, prompt, steps, guidance = 30, "a 'wide' bridge", 4, 2.0
    extra = {"seed": seed, "steps": steps, "guidance_scale": guidance}
    answer = client.images.generate(
        prompt=prompt, size="96x64", n=2, response_format="b64_json", extra_body=extra
    )
    assert len(answer.data) == 2
    for i, image in enumerate(answer.data):
        assert image.b64_json is not None
        got = glm_reference.png_pixels(base64.b64decode(image.b64_json))
        want = glm_reference.pipeline_pixels(
            deployment.pipe, prompt, seed + i, 96, 64, steps, guidance
        )
        assert np.array_equal(got, want), i
    bad: list[tuple[dict[str, Any], str]] = [
        ({"size": "48x64"}, "size"),  # not a multiple of 32 (the AR's check)
        ({"size": "64x4096"}, "size"),  # past the deploy's max_size
        ({"size": "64 by 64"}, "size"),
        ({"n": 11}, "n"),
        ({"n": 0}, "n"),
        ({"response_format": "url"}, "response_format"),
        ({"extra_body": {"steps": 0}}, "steps"),
        ({"extra_body": {"guidance_scale": "high"}}, "guidance_scale"),
    ]
    for kwargs, field in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.generate(prompt="x", **kwargs)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == field, (kwargs, error)
        assert field in error["message"], (kwargs, error)


def test_streamed_partial_images_then_the_pipelines_image(deployment: Deployment) -> None:
    """``stream=True, partial_images=2`` through the SDK: two ``image_generation.partial_image``
    events (indices 0, 1: previews the DiT decoded mid-loop), then ``image_generation.completed``
    whose PNG is the pipeline's; ``partial_images=0`` streams the image alone."""
    from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent

    client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="x", max_retries=0, timeout=120)
    seed, prompt = 31, "a 'slow' reveal"
    want = glm_reference.pipeline_pixels(deployment.pipe, prompt, seed, 64, 96, STEPS, GUIDANCE)
    stream = client.images.generate(
        prompt=prompt, size="64x96", stream=True, partial_images=2, extra_body={"seed": seed}
    )
    events = list(stream)
    assert [e.type for e in events] == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    *partials, done = events
    for index, event in enumerate(partials):
        assert isinstance(event, ImageGenPartialImageEvent)
        assert event.partial_image_index == index and event.size == "64x96"
        preview = glm_reference.png_pixels(base64.b64decode(event.b64_json))
        assert preview.shape == want.shape and not np.array_equal(preview, want)
    assert isinstance(done, ImageGenCompletedEvent) and done.size == "64x96"
    assert np.array_equal(glm_reference.png_pixels(base64.b64decode(done.b64_json)), want)
    alone = list(client.images.generate(prompt=prompt, size="64x96", stream=True, partial_images=0))
    assert [e.type for e in alone] == ["image_generation.completed"]


def test_run_stage_by_stage_gives_the_same_pixels(deployment: Deployment) -> None:
    """``/v1/run``: the AR's opaque hand-off (token ids, prompt, size; the seed), then the
    DiT's image."""
    seed, prompt = 6, "a lamp 'ON'"
    want = glm_reference.pipeline_pixels(deployment.pipe, prompt, seed, 64, 64, STEPS, GUIDANCE)
    first = {"stage_id": 0, "stage_input": {"prompt": prompt, "seed": seed, "size": 64}}
    status, body = post_json(deployment.url + "/v1/run", first)
    assert status == 200, body
    hop = json.loads(body)
    assert hop["next_stage_id"] == 1 and len(hop["stage_input"]) < 1024
    second = {"stage_id": 1, "stage_input": hop["stage_input"]}
    status, body = post_json(deployment.url + "/v1/run", second)
    assert status == 200, body
    output = json.loads(body)["output"]
    assert output["kind"] == "image" and output["mime_type"] == "image/png"
    assert np.array_equal(glm_reference.png_pixels(base64.b64decode(output["data"])), want)


def test_a_dit_killed_mid_denoise_costs_the_same_image(deployment: Deployment) -> None:
    """kill -9 of the engine of the DiT replica denoising the request (200 steps): the sidecar
    sees its engine die, the hop fails and is replayed on the other replica from the AR's
    kept input; the image is the pipeline's."""
    seed, prompt, steps = 12, "a 'slow' sunrise", 200
    want = glm_reference.pipeline_pixels(deployment.pipe, prompt, seed, 64, 64, steps, GUIDANCE)
    answer: list[tuple[int, bytes]] = []
    body = {"prompt": prompt, "seed": seed, "size": 64, "steps": steps}
    client = threading.Thread(
        target=lambda: answer.append(post_json(deployment.url + "/v1/generate", body, 120))
    )
    client.start()
    try:
        victim: list[int] = []

        def busy() -> bool:
            for dit in deployment.dits:
                if _metric(dit, "omni_stage_in_flight") >= 1:
                    victim.append(_engine_of(deployment.proc.pid, dit))
                    return True
            return False

        wait_until(busy, 60, interval=0.01)
        os.kill(victim[0], signal.SIGKILL)
    finally:
        client.join(150)
    ((status, raw),) = answer
    assert status == 200, raw
    ars = stage_pools(deployment.proc.stdout, 0, "ar")[""]
    assert sum(_metric(ar, "omni_stage_hop_retries") for ar in ars) >= 1  # it was replayed
    (output,) = json.loads(raw)["outputs"].values()
    assert np.array_equal(glm_reference.png_pixels(base64.b64decode(output["data"])), want)


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of a pod's samples of metric ``name`` (those whose labels hold ``label``)."""
    total = 0.0
    for line in http_get(url + "/metrics").decode().splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rpartition(" ")[2])
    return total


def _hops(url: str) -> float:
    """The hops a pod has taken (its ``omni_stage_requests_total{route="hop"}``)."""
    return _metric(url, "omni_stage_requests_total", 'route="hop"')


def _engine_of(root: int, url: str) -> int:
    """The pid of the engine process of the pod serving ``url``, among ``root``'s
    descendants (omni-up → its pods' sidecars → their engines)."""
    port = url.rsplit(":", 1)[1].rstrip("/")
    for pid in _descendants(root):
        argv = _argv(pid)
        if "omni_mesh.sidecar.cli_stage" in argv and argv[argv.index("--port") + 1] == port:
            for child in _children(pid):
                if "omni_mesh.engines" in _argv(child):
                    return child
    raise AssertionError(f"no engine process serves {url}")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []
