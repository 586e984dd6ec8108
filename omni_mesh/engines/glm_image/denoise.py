"""One request's denoising loop as ``GlmImagePipeline.__call__`` runs it, one step at a time, so
the DiT stage can hand the core a step per ``next()`` (a cancel stops a request within a step,
requests take turns at step boundaries).

:class:`Denoising` holds what the loop keeps between steps: the latent, the glyph embeddings of
the prompt and of the empty negative prompt, the upsampled prior tokens with their keep/drop
masks, the size conditions, the request's own FlowMatch-Euler scheduler and its timesteps, and
the (unused in text to image) DiT KV cache the pipeline passes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Denoising:
    """The state of one request's denoising (module docstring); :meth:`step` runs the next
    timestep, :attr:`done` once every one ran, :attr:`latents` the result."""

    def __init__(
        self,
        model: Any,
        latents: Tensor,
        cond: Tensor,
        uncond: Tensor | None,
        prior: Tensor,
        size: tuple[int, int],
        scheduler: Any,
        guidance: float,
        generator: torch.Generator,
    ) -> None:
        from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

        self.model = model
        self.latents = latents
        self.cond, self.uncond = cond, uncond
        self.guidance = guidance
        self.generator = generator  # the request's: it drew the noise (the VAE decode takes it)
        self.scheduler = scheduler
        self.timesteps: Tensor = scheduler.timesteps
        self.index = 0
        device, dtype = latents.device, cond.dtype
        self.common = {
            "prior_token_id": prior,
            "target_size": torch.tensor([list(size)], dtype=dtype, device=device),
            "crop_coords": torch.tensor([[0, 0]], dtype=dtype, device=device),
            "return_dict": False,
            "kv_caches": GlmImageKVCache(num_layers=model.config.num_layers),
        }
        self.keep = torch.zeros_like(prior, dtype=torch.bool)
        self.drop = torch.ones_like(prior, dtype=torch.bool)

    @property
    def done(self) -> bool:
        return self.index >= len(self.timesteps)

    def step(self) -> None:
        """One timestep: the conditional forward and, with guidance > 1, the unconditional one
        (two forwards, as the pipeline runs them), guidance, an Euler step."""
        t = self.timesteps[self.index]
        inputs = {
            "hidden_states": self.latents.to(self.model.dtype),
            "timestep": t.expand(1) - 1,
            **self.common,
        }
        noise = self.model(encoder_hidden_states=self.cond, prior_token_drop=self.keep, **inputs)
        noise = noise[0].float()
        if self.uncond is not None:
            free = self.model(
                encoder_hidden_states=self.uncond, prior_token_drop=self.drop, **inputs
            )
            free = free[0].float()
            noise = free + self.guidance * (noise - free)
        self.latents = self.scheduler.step(noise, t, self.latents, return_dict=False)[0]
        self.index += 1
        if self.done:
            self.common["kv_caches"].clear()
