"""glm-image stage 1, the DiT: the prior token ids → the image, as ``GlmImagePipeline.__call__``
makes it once its prior tokens are given (text to image).

1. the glyph embeddings of the prompt's quoted text and of the empty negative prompt
   (``glyphs.py``: ByT5 tokenizer, T5 encoder);
2. the latent noise [1, C, H/8, W/8] from the request's own generator seeded with its seed (the
   pipeline draws it from its generator, which its AR never advanced: the AR drew from the
   process RNG);
3. the pipeline's timesteps (``steps`` evenly from 1000, shifted by ``mu`` for the image's
   sequence length) on a FlowMatch-Euler scheduler of the request's own;
4. every step: the DiT on the conditional input (glyphs, prior tokens kept) and, with
   ``guidance_scale`` > 1, on the unconditional one (negative glyphs, prior tokens dropped), two
   forwards as the pipeline runs them; guidance; an Euler step;
5. the latent de-normalised (the VAE's ``latents_mean``/``latents_std``), ``AutoencoderKL.decode``,
   and the pipeline's own post-processing to 8-bit RGB.

A request's stream runs one step per ``next()`` (``denoise.py`` keeps its loop between steps),
whether or not the pipeline streams chunks: the core advances every running request by a step,
so requests take turns at step boundaries (up to the stage's ``max_num_seqs``), a cancel stops
one within a step, and the image comes whole with the last step. Each request runs its own
forwards (batch 1: the pipeline's computation, bit for bit), unless ``engine_extras.batch_steps``
is on: then the running requests of one shape take each step in shared forwards
(``denoise.step_together``), faster where the DiT is overhead-bound, each image within a few
pixel levels of its lone run instead of equal to it.

Input: array ``prior_token_ids`` int64 [H/32, W/32] (ids of the DiT's prior codebook, upsampled
2x here as the pipeline does); fields ``prompt``, ``width``, ``height``, ``steps`` (default
``engine_extras.steps``, 50), ``guidance_scale`` (a number, default ``engine_extras.
guidance_scale``, 1.5), ``partial_images`` (0-3, default 0). Final: array ``image`` uint8
[H, W, 3]; fields ``width``, ``height``.

Partial images (OpenAI's ``partial_images``): after ``partial_images`` evenly spaced steps
(:func:`preview_steps`) the stream yields a chunk for the client alone (``forward=False``) whose
final output is a preview: the VAE decode of the step's estimate of the clean latent
(``denoise.py``), with field ``partial_image_index``; the image itself is the last chunk,
unchanged by them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_mesh.data_plane.messages import Scalar
from omni_mesh.engines.base import EngineRequest, EngineResult, StageData
from omni_mesh.engines.batching.row_sampling import row_generator
from omni_mesh.engines.devices import torch_device
from omni_mesh.engines.extras import extra_bool, extra_float, extra_int
from omni_mesh.engines.fields import DEFAULT_MAX_PROMPT_BYTES, FieldReader
from omni_mesh.engines.glm_image.denoise import Denoising, step_together
from omni_mesh.engines.glm_image.folder import dtype_kwargs, part, stage_folder
from omni_mesh.engines.glm_image.glyphs import GlyphEncoder
from omni_mesh.engines.glm_image.inputs import MAX_SIDE, ImageSize, image_size
from omni_mesh.engines.glm_image.sampling import check_seed
from omni_mesh.engines.hf.common import parameter_count
from omni_mesh.engines.torch_engine import TorchEngine

STEPS_RANGE = (1, 200)
GUIDANCE_RANGE = (0.0, 30.0)
PARTIAL_RANGE = (0, 3)  # OpenAI's partial_images


@dataclass(frozen=True)
class DitInput:
    prompt: str
    size: ImageSize
    prior: np.ndarray  # int64 [H/32, W/32]
    steps: int
    guidance: float
    partial_images: int = 0  # previews streamed before the image


class GlmImageDitEngine(TorchEngine[DitInput]):
    """GLM-Image's glyph encoder, DiT, scheduler and VAE (module docstring)."""

    model: Any

    def build(self, seed: int) -> int:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
        from diffusers import GlmImageTransformer2DModel as Dit
        from diffusers.image_processor import VaeImageProcessor
        from transformers import ByT5Tokenizer, T5EncoderModel

        ctx = self.ctx
        self.max_prompt_bytes = extra_int(
            ctx, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, 1, 1 << 16
        )
        self.max_side = extra_int(ctx, "max_size", 2048, 32, MAX_SIDE)
        self.default_steps = extra_int(ctx, "steps", 50, *STEPS_RANGE)
        self.default_guidance = extra_float(ctx, "guidance_scale", 1.5, *GUIDANCE_RANGE)
        self.batch_steps = extra_bool(ctx, "batch_steps", False)
        self.jobs: list[Denoising] = []  # the requests whose streams denoise step by step
        folder = stage_folder(ctx)
        self.device = device = torch_device(ctx)
        self.model = Dit.from_pretrained(
            str(part(ctx, folder, "transformer")), **dtype_kwargs(ctx)
        ).to(device)
        self.vae = AutoencoderKL.from_pretrained(
            str(part(ctx, folder, "vae")), **dtype_kwargs(ctx)
        ).to(device)
        encoder = T5EncoderModel.from_pretrained(
            str(part(ctx, folder, "text_encoder")), **dtype_kwargs(ctx)
        ).to(device)
        tokenizer = ByT5Tokenizer.from_pretrained(str(part(ctx, folder, "tokenizer")))
        self.glyphs = GlyphEncoder(tokenizer, encoder.eval(), device)
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(
            str(part(ctx, folder, "scheduler"))
        )
        self.scheduler_class = FlowMatchEulerDiscreteScheduler
        self.scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.images = VaeImageProcessor(vae_scale_factor=self.scale)
        self.codebook = int(self.model.config.prior_vq_quantizer_codebook_size)
        self.model.eval()
        self.vae.eval()
        return sum(parameter_count(m) for m in (self.model, self.vae, encoder))

    def parse(self, request: EngineRequest) -> DitInput:
        fields = self.reader(request)
        check_seed(fields, request.seed)
        fields.prompt_bytes("prompt", self.max_prompt_bytes)
        size = image_size(fields, None, self.max_side)  # the AR hands its size on
        rows, cols = size.grid
        prior = fields.int_array("prior_token_ids", (rows, cols), self.codebook, rows)
        steps = fields.optional_int("steps", self.default_steps, *STEPS_RANGE)
        partial = fields.optional_int("partial_images", 0, *PARTIAL_RANGE)
        assert steps is not None and partial is not None
        prompt = fields.optional_str("prompt", "")
        return DitInput(prompt, size, prior, steps, self._guidance(fields), partial)

    def _guidance(self, fields: FieldReader) -> float:
        value = fields.data.fields.get("guidance_scale")
        if value is None:
            return self.default_guidance
        lo, hi = GUIDANCE_RANGE
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            raise fields.error("field", "guidance_scale", f"must be a number in [{lo}, {hi}]")
        return float(value)

    def open(self, batch: Sequence[EngineRequest]) -> list[Iterator[EngineResult | None]]:
        """One stream per request that runs one denoising step per ``next()`` (module
        docstring), whatever ``async_chunk`` says: the image comes whole at the end."""
        return self._streams(batch, streaming=True)

    def run(
        self, request: EngineRequest, inputs: DitInput, generator: torch.Generator
    ) -> EngineResult:
        job = self.start(request, inputs)
        while not job.done:
            job.step()
        return self.finish(request, inputs, job)

    def run_chunks(
        self, request: EngineRequest, inputs: DitInput, generator: torch.Generator
    ) -> Iterator[EngineResult | None]:
        job = self.start(request, inputs)
        self.jobs.append(job)
        try:
            while True:
                if job.stepped:  # this step ran in before_step's batched forwards
                    job.stepped = False
                else:
                    job.step()
                if job.done:
                    break
                # a preview (partial image) when this step was one, else nothing: the core's
                # other streams (and aborts) get their turn
                yield self.preview(request, inputs, job)
        finally:
            self.jobs.remove(job)  # done, failed or closed (a cancel): it steps no more
        yield self.finish(request, inputs, job)

    def before_step(self, streams: int) -> None:
        """With ``batch_steps``, the next step of every running request, those of one shape
        in shared forwards (``denoise.step_together``)."""
        if self.batch_steps and len(self.jobs) > 1:
            with torch.inference_mode():
                step_together(self.model, self.jobs)

    def start(self, request: EngineRequest, inputs: DitInput) -> Denoising:
        """Steps 1-3 of the module docstring: the request's loop, before its first step."""
        from diffusers.utils.torch_utils import randn_tensor

        generator = row_generator(request.seed, self.device)  # the pipeline's, not derived
        dtype = self.model.dtype
        cond = self.glyphs.embed(inputs.prompt, dtype)
        uncond = self.glyphs.embed("", dtype) if inputs.guidance > 1 else None
        size = inputs.size
        shape = (
            1,
            int(self.model.config.in_channels),
            size.height // self.scale,
            size.width // self.scale,
        )
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=cond.dtype)
        prior = _upsampled(torch.from_numpy(inputs.prior).to(self.device))
        scheduler = self._scheduler(size, inputs.steps)
        return Denoising(
            self.model,
            latents,
            cond,
            uncond,
            prior,
            (size.height, size.width),
            scheduler,
            inputs.guidance,
            generator,
            preview_steps(inputs.steps, inputs.partial_images),
        )

    def preview(
        self, request: EngineRequest, inputs: DitInput, job: Denoising
    ) -> EngineResult | None:
        """The image estimated at the step just run, when it was a preview step: a chunk for
        the client alone, numbered by ``partial_image_index``; None otherwise."""
        estimate = job.take_estimate()
        if estimate is None:
            return None
        index = sorted(job.previews).index(job.index)
        size = inputs.size
        fields: dict[str, Scalar] = {
            "width": size.width,
            "height": size.height,
            "partial_image_index": index,
        }
        final = StageData(fields=fields, arrays={"image": self.decode(estimate, None)})
        return EngineResult(request.request_id, final=final, last=False, forward=False)

    def finish(self, request: EngineRequest, inputs: DitInput, job: Denoising) -> EngineResult:
        """Step 5 of the module docstring: the request's final image."""
        image = self.decode(job.latents, job.generator)
        size = inputs.size
        final = StageData(
            fields={"width": size.width, "height": size.height}, arrays={"image": image}
        )
        return EngineResult(request.request_id, final=final)

    def _scheduler(self, size: ImageSize, steps: int) -> Any:
        """A scheduler of the request's own, set to the pipeline's timesteps and sigmas."""
        from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift

        scheduler = self.scheduler_class.from_config(self.scheduler_config)
        config = scheduler.config
        patch = int(self.model.config.patch_size)
        seq_len = ((size.height // self.scale) * (size.width // self.scale)) // patch**2
        train = config.num_train_timesteps
        timesteps = np.linspace(train, 1.0, steps + 1)[:-1].astype(np.int64).astype(np.float32)
        sigmas = timesteps / train
        mu = calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("base_shift", 0.25),
            config.get("max_shift", 0.75),
        )
        scheduler.set_timesteps(timesteps=timesteps, sigmas=sigmas, device=self.device, mu=mu)
        return scheduler

    def decode(self, latents: Tensor, generator: torch.Generator | None) -> np.ndarray:
        """Step 5: the latent → uint8 [H, W, 3], as the pipeline's ``output_type="pil"``."""
        vae = self.vae
        latents = latents.to(vae.dtype)
        channels = (1, int(vae.config.latent_channels), 1, 1)
        mean = (
            torch.tensor(vae.config.latents_mean).view(channels).to(latents.device, latents.dtype)
        )
        std = torch.tensor(vae.config.latents_std).view(channels).to(latents.device, latents.dtype)
        image = vae.decode(latents * std + mean, return_dict=False, generator=generator)[0]
        (pil,) = self.images.postprocess(image, output_type="pil")
        return np.ascontiguousarray(np.asarray(pil.convert("RGB"), dtype=np.uint8))

    def close(self) -> None:
        super().close()
        for name in ("vae", "glyphs"):
            vars(self).pop(name, None)


def preview_steps(steps: int, partial_images: int) -> frozenset[int]:
    """After which steps (counted from 1) the previews come: ``partial_images`` evenly spaced
    through the loop, none at its last step (the image itself); fewer when steps are few."""
    marks = (round(steps * j / (partial_images + 1)) for j in range(1, partial_images + 1))
    return frozenset(m for m in marks if 1 <= m < steps)


def _upsampled(grid: Tensor) -> Tensor:
    """[1, 4 h w]: the [h, w] grid upsampled 2x (nearest), as ``_upsample_token_ids``."""
    h, w = grid.shape
    ids = torch.nn.functional.interpolate(
        grid.view(1, 1, h, w).float(), scale_factor=2, mode="nearest"
    )
    return ids.to(torch.long).view(1, -1)
