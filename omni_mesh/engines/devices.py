"""Where a torch engine runs: its stage's device (checked once) and dtype.

A stage that lists ``devices`` runs its engine on CUDA: the sidecar gives the engine process
only its replica's slice (``CUDA_VISIBLE_DEVICES``), so the engine's first device is
``cuda:0``. A stage without ``devices`` runs on the CPU. A stage that lists devices on a machine
where torch sees no CUDA device is a configuration error (the stage exits 2), not a silent fall
back to the CPU.
"""

from __future__ import annotations

import torch

from omni_mesh.engines.base import EngineConfigError, EngineContext


def torch_device(ctx: EngineContext) -> torch.device:
    """The device the engine of ``ctx`` places its weights and inputs on."""
    if ctx.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EngineConfigError(
            f"stage {ctx.stage.stage_id} ({ctx.stage.name}) lists devices "
            f"{ctx.config.devices!r}, but torch sees no CUDA device here (CUDA_VISIBLE_DEVICES, "
            "the driver, a CPU-only torch?); remove devices: to run it on the CPU"
        )
    return torch.device(ctx.device, 0)


def torch_dtype(ctx: EngineContext) -> torch.dtype | str:
    """The stage's ``dtype`` as torch's; ``"auto"`` (unset, or said so): the checkpoint's own,
    as ``from_pretrained`` takes it."""
    names = {
        "half": torch.float16,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float": torch.float32,
        "float32": torch.float32,
    }
    return names.get(ctx.config.dtype or "auto", "auto")
