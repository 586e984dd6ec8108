"""The monolithic qwen3-omni server of ``python -m benchmarks omni``: transformers' own model,
served the way a user would serve it.

Run as a child process by :mod:`benchmarks.omni`::

    python -m benchmarks.omni_mono --port P --max-batch 1|8 [--threads N]

Loads ``Qwen3OmniMoeForConditionalGeneration`` from the ``tiny-qwen3-omni`` folder (the one the
omni-mesh stages load) and answers OpenAI's ``POST /v1/audio/speech`` (``response_format``
``pcm``: 16-bit mono PCM at 24 kHz, the whole answer in one body, since ``generate`` only has
the whole waveform at its end) with one ``model.generate(...)`` per batch, in one worker thread
so the event loop keeps accepting requests meanwhile:

* ``--max-batch 1``: one request at a time; the others wait in arrival order, as behind a lock.
* ``--max-batch 8``: each ``generate`` takes every request waiting when it starts, up to 8
  (no batching window: requests arriving meanwhile wait for the next one), prompts left-padded
  with an attention mask.

Every call: ``thinker_max_new_tokens=32`` (``<|im_end|>`` ends the text), ``talker_max_new_tokens
=64``, ``talker_do_sample=True``, ``speaker`` the request's ``voice``, seeded from the batch's
first request. ``GET /health`` answers ``{"threads": torch threads, "max_batch": N}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from omni_mesh.data_plane.media import pcm_bytes

logger = logging.getLogger("omni-mono")

MODEL = "tiny-qwen3-omni"
SERVED_NAME = "qwen3-omni"
THINKER_TOKENS = 32
TALKER_FRAMES = 64
SAMPLE_RATE = 24_000
FEATURE_RATE = 16_000


@dataclass
class Job:
    """One request waiting for its batch."""

    text: str
    voice: str
    done: asyncio.Future[bytes] = field(repr=False)


def take_batch(queue: list[Job], max_batch: int) -> list[Job]:
    """The next batch: up to ``max_batch`` of the oldest waiting jobs with the first job's voice
    (one ``speaker`` per ``generate`` call), removed from ``queue``."""
    if not queue:
        return []
    voice = queue[0].voice
    batch = [j for j in queue if j.voice == voice][:max_batch]
    for job in batch:
        queue.remove(job)
    return batch


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Token id rows left-padded to one length with ``pad_id``: (ids, attention mask)."""
    width = max((len(r) for r in rows), default=0)
    ids = [[pad_id] * (width - len(r)) + list(r) for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return ids, mask


def waveforms(out: Any, n: int) -> list[np.ndarray]:
    """The ``n`` waveforms (float32, 1-D) of ``generate``'s audio output: a tensor [1, 1, S] for
    one prompt, a list of n tensors [S_i] for a batch."""
    if isinstance(out, list | tuple):
        waves = [np.asarray(w.detach().float().cpu().numpy()).reshape(-1) for w in out]
    else:
        arr = np.asarray(out.detach().float().cpu().numpy())
        waves = [arr.reshape(-1)] if n == 1 else [row.reshape(-1) for row in arr]
    if len(waves) != n:
        raise RuntimeError(f"generate gave {len(waves)} waveforms for {n} prompts")
    return waves


class Monolith:
    """The whole model in this process and the ``generate`` call around it."""

    def __init__(self, threads: int) -> None:
        import torch
        from transformers import (
            AutoFeatureExtractor,
            AutoTokenizer,
            Qwen3OmniMoeForConditionalGeneration,
        )

        from omni_mesh.engines.hf.folders import resolve_folder

        if threads > 0:
            torch.set_num_threads(threads)
        self.torch = torch
        folder = str(resolve_folder(MODEL))
        self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.features = AutoFeatureExtractor.from_pretrained(folder)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.model.config.im_end_token_id)

    def prompt_ids(self, text: str) -> list[int]:
        from omni_mesh.engines.qwen3_omni.inputs import conversation, thinker_prompt

        conv = conversation("bench", None, text, FEATURE_RATE)
        prompt = thinker_prompt(self.tokenizer, self.features, conv)
        return [int(t) for t in prompt.input_ids[0].tolist()]

    def speak(self, texts: Sequence[str], voice: str, seed: int) -> list[bytes]:
        """PCM16 of each text's answer, all in one ``generate`` call."""
        torch = self.torch
        ids, mask = left_pad([self.prompt_ids(t) for t in texts], self.pad_id)
        torch.manual_seed(seed)
        with torch.inference_mode():
            _, audio = self.model.generate(
                input_ids=torch.tensor(ids, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                thinker_max_new_tokens=THINKER_TOKENS,
                thinker_eos_token_id=self.model.config.im_end_token_id,
                talker_max_new_tokens=TALKER_FRAMES,
                talker_do_sample=True,
                speaker=voice,
            )
        if audio is None:
            raise RuntimeError("generate returned no audio")
        return [pcm_bytes(w, SAMPLE_RATE) for w in waveforms(audio, len(texts))]


class Server:
    """``/v1/audio/speech`` in front of one :class:`Monolith` (module docstring)."""

    def __init__(self, mono: Monolith, max_batch: int) -> None:
        self.mono = mono
        self.max_batch = max_batch
        self.queue: list[Job] = []
        self.wake = asyncio.Event()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="generate")
        self.seed = 0

    async def speech(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("model") not in (SERVED_NAME, None):
            return web.json_response({"error": {"message": "unknown model"}}, status=404)
        if body.get("response_format", "pcm") != "pcm":
            return web.json_response({"error": {"message": "only pcm"}}, status=400)
        text = str(body.get("input") or "")
        if not text:
            return web.json_response({"error": {"message": "input is required"}}, status=400)
        job = Job(
            text, str(body.get("voice") or "ethan"), asyncio.get_running_loop().create_future()
        )
        self.queue.append(job)
        self.wake.set()
        try:
            pcm = await job.done
        except Exception as exc:
            logger.exception("generate failed")
            return web.json_response(
                {"error": {"message": f"{type(exc).__name__}: {exc}"}}, status=500
            )
        return web.Response(body=pcm, content_type="audio/pcm")

    async def health(self, request: web.Request) -> web.Response:
        threads = int(self.mono.torch.get_num_threads())
        return web.json_response({"threads": threads, "max_batch": self.max_batch})

    async def worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            batch = take_batch(self.queue, self.max_batch)
            if not batch:
                self.wake.clear()
                continue
            self.seed += 1
            texts = [j.text for j in batch]
            try:
                pcms = await loop.run_in_executor(
                    self.pool, self.mono.speak, texts, batch[0].voice, self.seed
                )
            except Exception as exc:  # every job of the batch gets the failure
                for job in batch:
                    job.done.set_exception(exc)
                continue
            for job, pcm in zip(batch, pcms, strict=True):
                job.done.set_result(pcm)

    async def serve(self, port: int) -> None:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/v1/audio/speech", self.speech)
        app.router.add_get("/health", self.health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        logger.info("omni-mono serving on 127.0.0.1:%d (max batch %d)", port, self.max_batch)
        try:
            await self.worker()
        finally:
            await runner.cleanup()
            self.pool.shutdown(wait=False, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.omni_mono", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=1, choices=range(1, 65), metavar="N")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = Server(Monolith(args.threads), args.max_batch)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
