"""glm-image stage 0, the AR: GLM-Image's ``GlmImageForConditionalGeneration`` writes the prior
token ids of a text-to-image request, as ``GlmImagePipeline.generate_prior_tokens`` does.

The prompt goes through the folder's ``GlmImageProcessor`` chat template as the pipeline sends
it (one user turn), which appends the target grid (H/32 x W/32) and the preview grid and the
image-start token; the model then decodes the preview grid's tokens, the target grid's and one
more (the pipeline's ``max_new_tokens``). Every running request is a row of one
:class:`~omni_mesh.engines.glm_image.ar_batch.PriorBatch`: one batched forward per token for all
of them, whatever their sizes (each row's 3D rope positions passed explicitly), up to the stage's
``max_num_seqs``; a request joins at the next step. Each token is drawn by ``generate``'s
processors for the folder's generation config (``sampling.py``) from the request's own generator
seeded with its seed: the draws the pipeline makes from the process RNG after
``torch.manual_seed(generator.initial_seed())``, so a request's tokens are those of its lone
pipeline call whatever else runs. An end-of-image token before the grids are full fails the
request (the pipeline would crash on the short grid).

Input fields: ``prompt`` (str), the size (``inputs.py``: ``size``, or ``width`` and ``height``),
``steps``, ``guidance_scale`` and ``partial_images`` (checked by the DiT, handed on). Output: array
``prior_token_ids`` int64 [H/32, W/32] (the target grid, before the DiT's 2x upsampling); fields
``prompt``, ``width``, ``height`` (and the DiT's fields when given).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_mesh.engines.base import (
    EngineConfigError,
    EngineRequest,
    EngineResult,
    StageData,
)
from omni_mesh.engines.batching.frame_batch import Row
from omni_mesh.engines.batching.frame_engine import FrameEngine
from omni_mesh.engines.batching.frame_stream import Chunker
from omni_mesh.engines.batching.row_sampling import RowPicker, row_generator
from omni_mesh.engines.devices import torch_device
from omni_mesh.engines.extras import extra_int
from omni_mesh.engines.fields import DEFAULT_MAX_PROMPT_BYTES, passthrough
from omni_mesh.engines.glm_image.ar_batch import ArPrompt, PriorBatch, PriorRow
from omni_mesh.engines.glm_image.folder import dtype_kwargs, part, stage_folder
from omni_mesh.engines.glm_image.inputs import (
    DEFAULT_SIDE,
    MAX_SIDE,
    MULTIPLE,
    ImageSize,
    image_size,
)
from omni_mesh.engines.glm_image.sampling import check_seed, generation_sampling
from omni_mesh.engines.hf.common import parameter_count

logger = logging.getLogger(__name__)

#: Fields the DiT reads, handed on as the request gave them.
HANDED_ON = ("steps", "guidance_scale", "partial_images")


@dataclass(frozen=True)
class ArInput:
    prompt: str
    size: ImageSize
    tokens: ArPrompt  # the chat-templated prompt and its grids


class GlmImageArEngine(FrameEngine[ArInput]):
    """GLM-Image's AR generator (module docstring)."""

    model: Any
    batch: PriorBatch

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
            str(ar_folder), **dtype_kwargs(ctx)
        )
        self.model = model.to(self.device).eval()
        generation = GenerationConfig.from_pretrained(str(ar_folder))
        picker = RowPicker(generation_sampling(generation, ctx))
        self.batch = PriorBatch(self.model, picker, int(self.model.config.image_end_token_id))
        # not streamed: a request's one result comes when its row ends
        self.first_chunk_frames = self.chunk_frames = 1 << 20
        return parameter_count(self.model)

    def parse(self, request: EngineRequest) -> ArInput:
        fields = self.reader(request)
        check_seed(fields, request.seed)
        fields.prompt_bytes("prompt", self.max_prompt_bytes)
        prompt = fields.optional_str("prompt", "")
        size = image_size(fields, self.default_side, self.max_side)
        return ArInput(prompt, size, self.tokenize(prompt, size))

    def row(self, request: EngineRequest, inputs: ArInput) -> PriorRow:
        # The pipeline's draws come from the seed itself, not the engine's derived generator.
        return PriorRow(
            request.request_id,
            row_generator(request.seed, self.device),
            prompt=inputs.tokens,
        )

    def chunker(self, request: EngineRequest, row: Row) -> Chunker:
        assert isinstance(row, PriorRow)

        def chunk(frames: list[np.ndarray], sent: int, last: bool) -> EngineResult | None:
            return self._result(request, row) if last else None

        return chunk

    def _result(self, request: EngineRequest, row: PriorRow) -> EngineResult:
        """The request's target grid, once its row ended."""
        assert row.prompt is not None
        grids = row.prompt.grids
        target_h, target_w = grids[0]
        preview = sum(h * w for h, w in grids[1:])
        grid = row.tokens[preview : preview + target_h * target_w]
        if len(grid) < target_h * target_w:
            message = (
                f"{self.where} request {request.request_id!r}: the AR ended the image after "
                f"{len(row.tokens)} of {row.total} tokens"
            )
            return EngineResult(request.request_id, error=message)
        fields = {
            "prompt": str(request.data.fields["prompt"]),
            "width": target_w * MULTIPLE,
            "height": target_h * MULTIPLE,
            **passthrough(request.data, HANDED_ON),
        }
        ids = np.array(grid, dtype=np.int64).reshape(target_h, target_w)
        output = StageData(fields=fields, arrays={"prior_token_ids": ids})
        return EngineResult(request.request_id, output=output)

    def tokenize(self, prompt: str, size: ImageSize) -> ArPrompt:
        """The chat-templated prompt with its target and preview grids, as the pipeline makes
        it (one user turn of one text part)."""
        messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
        encoded = self.processor.apply_chat_template(
            messages,
            tokenize=True,
            padding=False,
            # transformers 5.19 reads the target size here; as top-level kwargs (the pipeline's
            # way) it works too but logs a deprecation per request, and in processor_kwargs it is
            # silently ignored (the default 1152 x 768 grid).
            images_kwargs={"target_h": size.height, "target_w": size.width},
            return_dict=True,
            return_tensors="pt",
        )
        grids = [(int(t[1]), int(t[2])) for t in encoded["image_grid_thw"]]
        if grids[0] != size.grid:  # the processor rounds; inputs.py refused other sizes
            raise RuntimeError(f"{self.where}: the processor made grid {grids[0]} for {size}")
        return ArPrompt(
            encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device), grids
        )
