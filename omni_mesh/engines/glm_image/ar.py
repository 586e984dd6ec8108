"""glm-image stage 0, the AR: GLM-Image's ``GlmImageForConditionalGeneration`` writes the prior
token ids of a text-to-image request, as ``GlmImagePipeline.generate_prior_tokens`` does.

The prompt goes through the folder's ``GlmImageProcessor`` chat template as the pipeline sends
it (one user turn), which appends the target grid (H/32 x W/32) and the preview grid and the
image-start token; the model then decodes the preview grid's tokens, the target grid's and one
more (the pipeline's ``max_new_tokens``), from the 3D rope positions of ``positions.py`` passed
explicitly (the model's own per-call position state is never read, so requests of any size may
share the engine). Each token is drawn by ``generate``'s processors for the folder's generation
config (``sampling.py``) from the request's own generator seeded with its seed: the draws the
pipeline makes from the process RNG after ``torch.manual_seed(generator.initial_seed())``. An
end-of-image token before the grids are full fails the request (the pipeline would crash on the
short grid).

Input fields: ``prompt`` (str), the size (``inputs.py``: ``size``, or ``width`` and ``height``),
``steps`` and ``guidance_scale`` (checked by the DiT, handed on). Output: array
``prior_token_ids`` int64 [H/32, W/32] (the target grid, before the DiT's 2x upsampling); fields
``prompt``, ``width``, ``height`` (and ``steps``, ``guidance_scale`` when given).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from omni_mesh.engines.base import (
    EngineConfigError,
    EngineInputError,
    EngineRequest,
    EngineResult,
    StageData,
)
from omni_mesh.engines.batching.row_sampling import RowPicker, row_generator
from omni_mesh.engines.devices import torch_device
from omni_mesh.engines.extras import extra_int
from omni_mesh.engines.fields import DEFAULT_MAX_PROMPT_BYTES, passthrough
from omni_mesh.engines.glm_image.folder import dtype_kwargs, part, stage_folder
from omni_mesh.engines.glm_image.inputs import (
    DEFAULT_SIDE,
    MAX_SIDE,
    MULTIPLE,
    ImageSize,
    image_size,
)
from omni_mesh.engines.glm_image.positions import decode_positions, prompt_positions
from omni_mesh.engines.glm_image.sampling import check_seed, generation_sampling
from omni_mesh.engines.hf.common import parameter_count
from omni_mesh.engines.torch_engine import TorchEngine

logger = logging.getLogger(__name__)

#: Fields the DiT reads, handed on as the request gave them.
HANDED_ON = ("steps", "guidance_scale")


@dataclass(frozen=True)
class ArInput:
    prompt: str
    size: ImageSize


@dataclass(frozen=True)
class ArPrompt:
    """The processor's output for one request: its token ids and its grids."""

    input_ids: Tensor  # [1, L]
    attention_mask: Tensor  # [1, L]
    grids: list[tuple[int, int]]  # (h, w) of the target grid, then the preview grid


class GlmImageArEngine(TorchEngine[ArInput]):
    """GLM-Image's AR generator (module docstring)."""

    model: Any

    def build(self, seed: int) -> int:
        from transformers import (
            AutoProcessor,
            GenerationConfig,
            GlmImageForConditionalGeneration,
        )

        ctx = self.ctx
        self.max_prompt_bytes = extra_int(
            ctx, "max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES, 1, 1 << 16
        )
        self.max_side = extra_int(ctx, "max_size", 2048, 32, MAX_SIDE)
        default = min(DEFAULT_SIDE, self.max_side // MULTIPLE * MULTIPLE)
        self.default_side = extra_int(ctx, "size", default, MULTIPLE, self.max_side)
        if self.default_side % MULTIPLE:
            raise EngineConfigError(
                f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.size must be a "
                f"multiple of {MULTIPLE}, got {self.default_side}"
            )
        folder = stage_folder(ctx)
        ar_folder = part(ctx, folder, "vision_language_encoder")
        self.processor = AutoProcessor.from_pretrained(str(part(ctx, folder, "processor")))
        self.device = torch_device(ctx)
        model = GlmImageForConditionalGeneration.from_pretrained(
            str(ar_folder), **dtype_kwargs(ctx, "dtype")
        )
        self.model = model.to(self.device).eval()
        generation = GenerationConfig.from_pretrained(str(ar_folder))
        self.sampling = generation_sampling(generation, ctx)
        self.picker = RowPicker(self.sampling)
        self.eos = self.model.config.image_end_token_id
        return parameter_count(self.model)

    def parse(self, request: EngineRequest) -> ArInput:
        fields = self.reader(request)
        check_seed(fields, request.seed)
        fields.prompt_bytes("prompt", self.max_prompt_bytes)
        prompt = fields.optional_str("prompt", "")
        return ArInput(prompt, image_size(fields, self.default_side, self.max_side))

    def run(
        self, request: EngineRequest, inputs: ArInput, generator: torch.Generator
    ) -> EngineResult:
        # The pipeline's draws come from the seed itself, not the engine's derived generator.
        own = row_generator(request.seed, self.device)
        prompt = self.tokenize(inputs)
        tokens = self.decode(prompt, own)
        target_h, target_w = prompt.grids[0]
        preview = sum(h * w for h, w in prompt.grids[1:])
        grid = tokens[preview : preview + target_h * target_w]
        if len(grid) < target_h * target_w:
            raise EngineInputError(
                f"{self.where} request {request.request_id!r}: the AR ended the image after "
                f"{len(tokens)} of {preview + target_h * target_w + 1} tokens"
            )
        ids = torch.tensor(grid, dtype=torch.int64).view(target_h, target_w)
        fields = {
            "prompt": inputs.prompt,
            "width": inputs.size.width,
            "height": inputs.size.height,
            **passthrough(request.data, HANDED_ON),
        }
        output = StageData(fields=fields, arrays={"prior_token_ids": ids.numpy()})
        return EngineResult(request.request_id, output=output)

    def tokenize(self, inputs: ArInput) -> ArPrompt:
        """The chat-templated prompt with its target and preview grids, as the pipeline makes
        it (one user turn of one text part)."""
        messages = [[{"role": "user", "content": [{"type": "text", "text": inputs.prompt}]}]]
        encoded = self.processor.apply_chat_template(
            messages,
            tokenize=True,
            padding=False,
            # transformers 5.19 reads the target size here; as top-level kwargs (the pipeline's
            # way) it works too but logs a deprecation per request, and in processor_kwargs it is
            # silently ignored (the default 1152 x 768 grid).
            images_kwargs={"target_h": inputs.size.height, "target_w": inputs.size.width},
            return_dict=True,
            return_tensors="pt",
        )
        grids = [(int(t[1]), int(t[2])) for t in encoded["image_grid_thw"]]
        if grids[0] != inputs.size.grid:  # the processor rounds; inputs.py refused other sizes
            raise RuntimeError(
                f"{self.where}: the processor made grid {grids[0]} for {inputs.size}"
            )
        return ArPrompt(
            encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device), grids
        )

    def decode(self, prompt: ArPrompt, generator: torch.Generator) -> list[int]:
        """The prior tokens: every grid's, then one more; fewer when the model ends early."""
        from transformers import DynamicCache

        length = int(prompt.input_ids.shape[-1])
        positions = decode_positions(length, prompt.grids, self.device)
        total = int(positions.shape[1])
        history: list[list[int]] = [prompt.input_ids[0].tolist()]
        cache = DynamicCache(config=self.model.config.text_config)
        out = self.model(
            input_ids=prompt.input_ids,
            attention_mask=prompt.attention_mask,
            position_ids=prompt_positions(length, self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens: list[int] = []
        while True:
            (token,) = self.picker.pick(out.logits[:, -1], history, [generator])
            tokens.append(token)
            if token == self.eos or len(tokens) == total:
                return tokens
            history[0].append(token)
            step = len(tokens) - 1
            out = self.model(
                input_ids=torch.tensor([[token]], device=self.device),
                attention_mask=torch.ones(
                    (1, length + len(tokens)), dtype=prompt.attention_mask.dtype, device=self.device
                ),
                position_ids=positions[:, step : step + 1].view(3, 1, 1),
                past_key_values=cache,
                use_cache=True,
            )
