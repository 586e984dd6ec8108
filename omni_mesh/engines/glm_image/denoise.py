"""One request's denoising loop as ``GlmImagePipeline.__call__`` runs it, one step at a time, so
the DiT stage can hand the core a step per ``next()`` (a cancel stops a request within a step,
requests take turns at step boundaries), and several requests' steps in one forward.

:class:`Denoising` holds what the loop keeps between steps: the latent, the glyph embeddings of
the prompt and of the empty negative prompt, the upsampled prior tokens with their keep/drop
masks, the size conditions, the request's own FlowMatch-Euler scheduler and its timesteps, and
the (unused in text to image) DiT KV cache the pipeline passes. :meth:`Denoising.step` runs its
next step alone: the pipeline's computation, bit for bit. At the steps a request asks previews
after (partial images), it also keeps the flow's estimate of the clean latent,
``x_t - sigma_t * v`` (v the guided velocity the step used): a read of the state, nothing the
loop itself uses, so the final image is unchanged.

:func:`step_together` runs the next step of many requests: those of one shape (latent size,
glyph length, guidance on or off) in one conditional forward and one unconditional forward over
their rows, each row at its own timestep and size condition, then each request's own guidance
and scheduler step. The rows' results match their lone forwards up to the kernels' last float
bits (a matmul over B rows is not bit-identical to B matmuls), so a batched request's image is
within a few pixel levels of its lone one, not always equal to it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


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
        previews: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.latents = latents
        self.cond, self.uncond = cond, uncond
        self.prior = prior
        self.guidance = guidance
        self.generator = generator  # the request's: it drew the noise (the VAE decode takes it)
        self.scheduler = scheduler
        self.timesteps: Tensor = scheduler.timesteps
        self.index = 0
        self.stepped = False  # this core step's step was run by :func:`step_together`
        self.previews = previews  # after which steps (counted from 1) to estimate the image
        self.estimate: Tensor | None = None  # the clean latent estimated at a preview step
        device, dtype = latents.device, cond.dtype
        self.target = torch.tensor([list(size)], dtype=dtype, device=device)
        self.crop = torch.tensor([[0, 0]], dtype=dtype, device=device)
        self.keep = torch.zeros_like(prior, dtype=torch.bool)
        self.drop = torch.ones_like(prior, dtype=torch.bool)

    @property
    def done(self) -> bool:
        return self.index >= len(self.timesteps)

    @property
    def shape(self) -> tuple[Any, ...]:
        """What must agree for rows to share a forward."""
        uncond = None if self.uncond is None else tuple(self.uncond.shape)
        return (tuple(self.latents.shape), tuple(self.cond.shape), uncond)

    def take_estimate(self) -> Tensor | None:
        """The clean latent estimated at the step just run, if it was a preview step."""
        estimate, self.estimate = self.estimate, None
        return estimate

    def timestep(self) -> Tensor:
        """[1]: the DiT's timestep input of the next step (the pipeline's ``t - 1``)."""
        return self.timesteps[self.index].expand(1) - 1

    def step(self) -> None:
        """One timestep alone: the conditional forward and, with guidance > 1, the
        unconditional one (two forwards, as the pipeline runs them), guidance, an Euler step."""
        cond, uncond = _forwards(self.model, [self])
        self.advance(cond, uncond)

    def advance(self, cond: Tensor, uncond: Tensor | None) -> None:
        """Guidance over this request's noise predictions, its scheduler's Euler step."""
        noise = cond if uncond is None else uncond + self.guidance * (cond - uncond)
        if self.index + 1 in self.previews:  # the flow's clean estimate, x_t - sigma_t * v
            sigma = self.scheduler.sigmas[self.index]
            self.estimate = self.latents.to(torch.float32) - sigma * noise
        t = self.timesteps[self.index]
        self.latents = self.scheduler.step(noise, t, self.latents, return_dict=False)[0]
        self.index += 1


def step_together(model: Any, jobs: Sequence[Denoising]) -> None:
    """The next step of every job, the jobs of one :attr:`~Denoising.shape` in shared forwards
    (module docstring); each job's :attr:`~Denoising.stepped` set. A group whose batched
    forward fails is left unstepped (each job then steps alone)."""
    groups: dict[tuple[Any, ...], list[Denoising]] = defaultdict(list)
    for job in jobs:
        if not job.done:
            groups[job.shape].append(job)
    for group in groups.values():
        try:
            cond, uncond = _forwards(model, group)
        except Exception:
            logger.exception(
                "a batched DiT step of %d requests failed; each steps alone", len(group)
            )
            continue
        for i, job in enumerate(group):
            job.advance(cond[i : i + 1], None if uncond is None else uncond[i : i + 1])
            job.stepped = True


def _forwards(model: Any, jobs: Sequence[Denoising]) -> tuple[Tensor, Tensor | None]:
    """The conditional noise predictions [B, C, h, w] of ``jobs`` (one shape), and the
    unconditional ones when they guide."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    def cat(tensors: list[Tensor]) -> Tensor:
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    common = {
        "hidden_states": cat([job.latents.to(model.dtype) for job in jobs]),
        "prior_token_id": cat([job.prior for job in jobs]),
        "timestep": cat([job.timestep() for job in jobs]),
        "target_size": cat([job.target for job in jobs]),
        "crop_coords": cat([job.crop for job in jobs]),
        "return_dict": False,
        "kv_caches": GlmImageKVCache(num_layers=model.config.num_layers),
    }
    keep = cat([job.keep for job in jobs])
    cond = model(encoder_hidden_states=cat([j.cond for j in jobs]), prior_token_drop=keep, **common)
    if jobs[0].uncond is None:
        return cond[0].float(), None
    uncond_embeds = cat([j.uncond for j in jobs if j.uncond is not None])
    drop = cat([job.drop for job in jobs])
    uncond = model(encoder_hidden_states=uncond_embeds, prior_token_drop=drop, **common)
    return cond[0].float(), uncond[0].float()
