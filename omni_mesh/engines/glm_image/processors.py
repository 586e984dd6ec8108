"""The glm-image processor: the AR's output → the DiT's input. Only what the DiT reads crosses:
the prior token ids (the target grid), the prompt (the glyph encoder reads its quoted text), the
size and the DiT's own request fields; the seed travels with every hop (``StageInput.seed``)."""

from __future__ import annotations

from omni_mesh.engines.base import EngineInputError, StageData
from omni_mesh.engines.fields import passthrough

_FIELDS = ("prompt", "width", "height", "steps", "guidance_scale", "partial_images")


def ar_to_dit(data: StageData) -> StageData:
    """``prior_token_ids`` int64 [H/32, W/32]; fields ``prompt``, ``width``, ``height`` (and
    ``steps``, ``guidance_scale``, ``partial_images`` when set)."""
    ids = data.arrays.get("prior_token_ids")
    if ids is None:
        raise EngineInputError("processor ar_to_dit: upstream output lacks 'prior_token_ids'")
    for name in ("prompt", "width", "height"):
        if data.fields.get(name) is None:
            raise EngineInputError(f"processor ar_to_dit: upstream output lacks field {name!r}")
    return StageData(fields=passthrough(data, _FIELDS), arrays={"prior_token_ids": ids})
