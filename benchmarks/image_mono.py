"""The monolithic reference of ``python -m benchmarks image``: diffusers' ``GlmImagePipeline`` on
the tiny-glm-image folder behind a small aiohttp server, one request at a time (the others wait
their turn), answering OpenAI's ``POST /v1/images/generations`` (unary, ``b64_json``) so that the
benchmark's SDK client is the same for both systems. ``GET /health`` says how many torch threads
it runs (``--threads``; torch's default, every core, when 0).

``python -m benchmarks.image_mono --port PORT [--threads N]``
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import logging

import torch
from aiohttp import web

from omni_mesh.engines.hf.folders import resolve_folder

logger = logging.getLogger(__name__)

PIPE: web.AppKey[object] = web.AppKey("pipe", object)
LOCK: web.AppKey[asyncio.Lock] = web.AppKey("lock", asyncio.Lock)


def _png(pipe: object, prompt: str, seed: int, width: int, height: int, steps: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    (image,) = pipe(  # type: ignore[operator]
        prompt, height=height, width=width, num_inference_steps=steps, generator=generator
    ).images
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


async def generations(request: web.Request) -> web.Response:
    body = await request.json()
    width, height = (int(x) for x in str(body.get("size", "256x256")).split("x"))
    args = (str(body["prompt"]), int(body.get("seed", 0)), width, height, int(body["steps"]))
    async with request.app[LOCK]:  # one request at a time, as the pipeline is called
        png = await asyncio.to_thread(_png, request.app[PIPE], *args)
    return web.json_response({"created": 0, "data": [{"b64_json": base64.b64encode(png).decode()}]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "threads": torch.get_num_threads()})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.image_mono")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    from diffusers import GlmImagePipeline

    app = web.Application(client_max_size=1 << 20)
    app[PIPE] = GlmImagePipeline.from_pretrained(str(resolve_folder("tiny-glm-image")))
    app[PIPE].set_progress_bar_config(disable=True)  # type: ignore[attr-defined]
    app[LOCK] = asyncio.Lock()
    app.router.add_post("/v1/images/generations", generations)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
