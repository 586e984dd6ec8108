"""What the transformers engines share: the model folder, loading one part of it.

A stage of a real-architecture pipeline loads only its own submodule of one Hugging Face folder
(``engine_extras.model``: a tiny registered name or a folder path, see ``folders.py``): the
thinker stage reads the ``thinker.*`` tensors of the checkpoint, the talker ``talker.*``, and so
on, through transformers' own loader (``from_pretrained`` with a ``key_mapping`` that strips the
prefix; the tensors of the other parts are skipped unread).

A part is placed on the stage's device in its dtype (``engines/devices.py``). Each request
samples with a generator of its own (``row_sampling.row_generator``), seeded as
``torch.manual_seed(seed)`` seeds the process's, so its samples depend on its seed alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, TypeVar

import torch

from omni_mesh.engines.base import EngineConfigError, EngineContext
from omni_mesh.engines.devices import torch_device, torch_dtype
from omni_mesh.engines.hf.folders import ModelFolderError, resolve_folder

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT")

#: Talker configs whose checkpoints store MoE experts one by one, like their thinker's: transformers
#: registers the fusing conversion for ``qwen3_omni_moe`` and its thinker only.
_MOE_CONVERSIONS = {"qwen3_omni_moe_talker": "qwen2_moe", "qwen3_omni_moe_talker_text": "qwen2_moe"}


def model_folder(ctx: EngineContext, default: str) -> Path:
    """The folder named by ``engine_extras.model`` (``default`` when unset), built if tiny."""
    model = ctx.config.engine_extras.get("model", default)
    if not isinstance(model, str) or not model:
        raise EngineConfigError(
            f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.model must be a "
            f"model name or folder, got {model!r}"
        )
    try:
        return resolve_folder(model)
    except ModelFolderError as exc:
        raise EngineConfigError(f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): {exc}") from None


def load_part(
    cls: type[ModelT],
    folder: Path,
    config: Any,
    prefix: str,
    ctx: EngineContext | None = None,
) -> ModelT:
    """Submodule ``prefix`` of the checkpoint in ``folder``, as ``cls`` with ``config``, on the
    stage's device in its dtype (``ctx``: its ``devices`` and ``dtype``; without: the CPU and
    the checkpoint's dtype).

    A tensor of the part missing from the checkpoint (a folder without a talker, say) is an
    :class:`EngineConfigError`: random weights are never served. The part's generation config
    is the one its config makes, as the monolithic model's submodule has it (the folder's
    ``generation_config.json`` is the whole model's)."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    _register_moe_conversions()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # not the table of the other parts' tensors, left unread
    try:
        model, info = cls.from_pretrained(  # type: ignore[attr-defined]
            str(folder),
            config=config,
            key_mapping={rf"^{prefix}\.": ""},
            output_loading_info=True,
            dtype="auto" if ctx is None else torch_dtype(ctx),
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise EngineConfigError(
            f"model folder {str(folder)!r} lacks {len(missing)} tensor(s) of its {prefix!r} "
            f"part, e.g. {prefix}.{missing[0]}"
        )
    if getattr(model, "generation_config", None) is not None:
        model.generation_config = GenerationConfig.from_model_config(model.config)
    if ctx is not None:
        model = model.to(torch_device(ctx))
    model.eval()
    return model  # type: ignore[no-any-return]


def _register_moe_conversions() -> None:
    from transformers import conversion_mapping as cm

    for model_type, base in _MOE_CONVERSIONS.items():
        if cm.get_checkpoint_conversion_mapping(model_type) is None:
            cm.register_checkpoint_conversion_mapping(
                model_type, cm.get_checkpoint_conversion_mapping(base)
            )


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
