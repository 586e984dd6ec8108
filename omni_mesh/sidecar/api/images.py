"""``POST /v1/images/generations``: OpenAI's image generation for a pipeline whose final output
is an image (``glm-image``, ``tiny-image``).

Fields: ``prompt``; ``size`` as ``WIDTHxHEIGHT`` (or ``auto``/absent: the pipeline's default):
any sides for a pipeline that takes ``width`` and ``height`` (``glm-image``: its engines refuse
sides that are not multiples of 32 or past their ``max_size``, a 400 naming ``size``), square
sides of 16..512 for one that takes ``size`` alone (``tiny-image``); ``n`` 1..10 images, n
requests seeded ``seed + i`` (``choices.py``); ``response_format`` ``b64_json`` (there is no
image store to serve a ``url`` from: a 400 naming it); ``output_format`` ``png``. Extensions (the
SDK's ``extra_body``): ``seed``, ``steps``, ``guidance_scale``, each a 400 naming it where the
pipeline does not take it.

``stream: true`` answers with OpenAI's image events (SSE): for each image, its
``partial_images`` previews (0..3; a pipeline that takes the field streams them, its image stage
sends each preview as a chunk of its output before the image itself) as
``image_generation.partial_image`` events with ``partial_image_index``, then
``image_generation.completed`` with the image. With n > 1 the images' events interleave; each
carries the image's ``index`` (an extension: OpenAI's events have none).
"""

from __future__ import annotations

import base64
import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec
from omni_mesh.data_plane import wire
from omni_mesh.data_plane.messages import MAX_IMAGE_SIDE, Prompt
from omni_mesh.sidecar.api.choices import choice_prompts, collect_choices, respond_choices
from omni_mesh.sidecar.api.client_requests import entry, request_frames
from omni_mesh.sidecar.api.openai_types import ImageRequest
from omni_mesh.sidecar.api.outputs import FinalOutput, OutputChunk, final_stage
from omni_mesh.sidecar.api.sinks import SSE_CONTENT_TYPE, sse
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.errors import ApiError, bad_request, decode_body, error_body

MAX_IMAGE_BODY = 1 << 20
SQUARE_SIDES = (16, 512)  # a pipeline that takes ``size`` alone (tiny-image)
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")
#: Engine fields as the route's fields (an engine's bad input names its own field).
_ROUTE_FIELD = {
    "width": "size",
    "height": "size",
    "size": "size",
    "prompt": "prompt",
    "steps": "steps",
    "guidance_scale": "guidance_scale",
    "partial_images": "partial_images",
}
_ENGINE_FIELD = re.compile(r"field '(\w+)'")
#: The fields OpenAI's image events carry that this server does not vary.
_EVENT_FIELDS = {"background": "opaque", "output_format": "png", "quality": "auto"}
_USAGE = {  # not counted: the engines report no token usage for images
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}


def image_size(pipeline: PipelineSpec, size: str | None) -> dict[str, int]:
    """The prompt fields of ``size`` (module docstring); a 400 naming ``size`` otherwise."""
    if size is None or size == "auto":
        return {}
    match = _SIZE.fullmatch(size.strip().lower())
    if match is None:
        raise bad_request(f"size: {size!r} is not WIDTHxHEIGHT (or auto)", "size")
    width, height = int(match[1]), int(match[2])
    if "width" in pipeline.prompt_fields:
        if not (16 <= width <= MAX_IMAGE_SIDE and 16 <= height <= MAX_IMAGE_SIDE):
            raise bad_request(
                f"size: {size!r}: each side must be in [16, {MAX_IMAGE_SIDE}] pixels", "size"
            )
        return {"width": width, "height": height}
    lo, hi = SQUARE_SIDES
    if width != height or not lo <= width <= hi:
        raise bad_request(
            f"size: {size!r}: pipeline {pipeline.name!r} makes square images, "
            f"{lo}x{lo} .. {hi}x{hi}",
            "size",
        )
    return {"size": width}


def _extensions(pipeline: PipelineSpec, req: ImageRequest) -> dict[str, Any]:
    """``steps``, ``guidance_scale`` and (streaming) ``partial_images`` as prompt fields; a 400
    naming the one the pipeline does not take."""
    asked: dict[str, Any] = {"steps": req.steps, "guidance_scale": req.guidance_scale}
    if req.stream and req.partial_images:
        asked["partial_images"] = req.partial_images
    fields = {}
    for name, value in asked.items():
        if value is None:
            continue
        if name not in pipeline.prompt_fields:
            raise bad_request(f"{name}: pipeline {pipeline.name!r} does not take it", name)
        fields[name] = value
    return fields


def _check_formats(req: ImageRequest) -> None:
    if req.response_format not in (None, "b64_json"):
        raise bad_request(
            f"response_format: {req.response_format!r} is not served (b64_json only: "
            "there is no image store to serve urls from)",
            "response_format",
        )
    if req.output_format not in (None, "png"):
        raise bad_request(
            f"output_format: {req.output_format!r} is not served (png only)", "output_format"
        )


@contextlib.contextmanager
def _engine_fields_named() -> Iterator[None]:
    """An engine's bad input (a 400 that names the engine's field) naming the route's field."""
    try:
        yield
    except ApiError as exc:
        match = _ENGINE_FIELD.search(exc.message)
        param = _ROUTE_FIELD.get(match[1]) if match is not None else None
        if exc.status == 400 and exc.param is None and param is not None:
            raise ApiError(400, f"{param}: {exc.message}", param=param, type_=exc.type) from None
        raise


async def generations(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    pipeline = pod.pipeline
    raw = await wire.read_body(request, max_bytes=MAX_IMAGE_BODY)
    req: ImageRequest = decode_body(raw, ImageRequest, what="request body")
    if req.model is not None and req.model != pipeline.name:
        raise ApiError(
            404,
            f"model {req.model!r} not found (this server serves {pipeline.name!r})",
            param="model",
            type_="model_not_found",
        )
    image_stage = final_stage(pipeline, OutputKind.IMAGE)
    if image_stage is None:
        raise bad_request(f"pipeline {pipeline.name!r} produces no images", "model")
    _check_formats(req)
    fields = {**image_size(pipeline, req.size), **_extensions(pipeline, req)}
    prompt = Prompt(prompt=req.prompt, seed=req.seed, priority=req.priority, **fields)
    streams = [
        request_frames(pod, request, entry(pod, request, p, param="prompt"))
        for p in choice_prompts(prompt, req.n)
    ]
    with _engine_fields_named():
        if req.stream:
            sink = ImageEvents(image_stage)
            return await respond_choices(request, pipeline, streams, sink)
        choices = await collect_choices(pipeline, streams)
    data = [{"b64_json": _b64(_image(image_stage, outputs))} for outputs in choices]
    return web.json_response({"created": int(time.time()), "data": data})


def _image(image_stage: int, outputs: list[FinalOutput]) -> FinalOutput:
    image = next((o for o in outputs if o.stage_id == image_stage), None)
    if image is None or image.data is None:
        raise ApiError(500, f"stage {image_stage}: no image output", type_="engine_error")
    return image


def _b64(image: FinalOutput) -> str:
    assert image.data is not None
    return base64.b64encode(image.data).decode()


def _size_text(image: FinalOutput) -> str:
    assert image.array is not None
    height, width = image.array.shape[:2]
    return f"{width}x{height}"


class ImageEvents:
    """The events of ``stream: true`` (module docstring), for the images of n choices. A chunk
    of the image stage whose fields carry ``partial_image_index`` is a preview; the stage's
    last chunk is the image (its joined output)."""

    content_type = SSE_CONTENT_TYPE
    encodes = True  # a preview is PNG-encoded here: off the event loop (``respond_choices``)

    def __init__(self, image_stage: int) -> None:
        self.image_stage = image_stage

    def piece(self, index: int, chunk: OutputChunk) -> bytes:
        partial = (chunk.output.fields or {}).get("partial_image_index")
        if chunk.stage_id != self.image_stage or partial is None:
            return b""  # the image itself goes in the completed event (end)
        preview = chunk.output.encoded()
        event = {
            "type": "image_generation.partial_image",
            "b64_json": _b64(preview),
            "partial_image_index": int(partial),
            "index": index,
            "created_at": int(time.time()),
            "size": _size_text(preview),
            **_EVENT_FIELDS,
        }
        return sse(event)

    def end(self, index: int, outputs: list[FinalOutput]) -> bytes:
        image = _image(self.image_stage, outputs)
        event = {
            "type": "image_generation.completed",
            "b64_json": _b64(image),
            "index": index,
            "created_at": int(time.time()),
            "size": _size_text(image),
            "usage": _USAGE,
            **_EVENT_FIELDS,
        }
        return sse(event)

    def tail(self, choices: list[list[FinalOutput]]) -> bytes:
        return b""  # OpenAI's image stream ends with the last completed event

    def error_event(self, err: ApiError) -> bytes:
        return sse({"type": "error", "error": error_body(err)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/images/generations", generations)
