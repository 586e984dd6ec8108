"""The glm-image stages apart, for ``python -m benchmarks image``: in this process, one torch
thread as an engine runs, the AR's prior tokens per second (omni-mesh's AR engine with 1 and 8
rows; the pipeline's ``generate_prior_tokens``) and a DiT step's time (omni-mesh's DiT engine;
the pipeline given the prior tokens, its whole DiT call over its steps, glyph encoding and VAE
decode included in both), and one partial image's VAE decode."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.measure import percentile

PIPELINE = "glm-image"


@dataclass
class StageCosts:
    ar_tokens: int  # prior tokens per request (both grids and one more)
    ar_one: float  # tokens/s, omni-mesh's AR engine, one row
    ar_eight: float  # tokens/s, omni-mesh's AR engine, eight rows
    ar_pipe: float  # tokens/s, GlmImagePipeline.generate_prior_tokens
    dit_step: float  # s per step, omni-mesh's DiT engine (glyphs and decode included)
    dit_pipe: float  # s per step, GlmImagePipeline given the prior tokens
    preview: float  # s, one partial image's VAE decode


def stage_costs(reps: int, side: int, steps: int, prompt: Callable[[int], str]) -> StageCosts:
    """The stages apart at ``side`` x ``side`` and ``steps`` (module docstring)."""
    from omni_mesh.engines.base import EngineRequest, StageData
    from omni_mesh.engines.glm_image.inputs import ImageSize
    from omni_mesh.engines.glm_image.processors import ar_to_dit
    from tests.engines.glm_image.glm_reference import monolithic
    from tests.engines.helpers import make_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ar = make_engine(PIPELINE, 0)
        dit = make_engine(PIPELINE, 1, steps=steps)
        pipe = monolithic()
        pipe.set_progress_bar_config(disable=True)
        tokens = sum(h * w for h, w in ar.tokenize(prompt(0), ImageSize(side, side)).grids) + 1

        def requests(n: int, base: int) -> list[EngineRequest]:
            fields = {"prompt": prompt(base), "width": side, "height": side}
            return [
                EngineRequest(f"r{base + i}", base + i, StageData(dict(fields))) for i in range(n)
            ]

        def timed(fn: Any) -> float:
            fn()  # a warm-up
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return percentile(times, 50)

        (prior,) = ar.execute(requests(1, 0))
        ids = prior.output.arrays["prior_token_ids"]
        dit_in = ar_to_dit(prior.output)
        upsampled = pipe._upsample_token_ids(torch.from_numpy(ids).reshape(-1), *ids.shape)
        generator = torch.Generator()
        one = timed(lambda: ar.execute(requests(1, 0)))
        eight = timed(lambda: ar.execute(requests(8, 0)))
        ar_pipe = timed(lambda: pipe.generate_prior_tokens(
            prompt(0), side, side, generator=generator.manual_seed(0)))  # fmt: skip
        dit_run = timed(lambda: dit.execute([EngineRequest("d", 0, dit_in)]))
        dit_pipe = timed(lambda: pipe(
            prompt(0), height=side, width=side, num_inference_steps=steps,
            prior_token_ids=upsampled, generator=generator.manual_seed(0)))  # fmt: skip
        latent = torch.zeros(1, int(dit.vae.config.latent_channels), side // 8, side // 8)
        with torch.inference_mode():
            preview = timed(lambda: dit.decode(latent, None))
    finally:
        torch.set_num_threads(threads)
    return StageCosts(
        tokens, tokens / one, 8 * tokens / eight, tokens / ar_pipe, dit_run / steps,
        dit_pipe / steps, preview,
    )  # fmt: skip
