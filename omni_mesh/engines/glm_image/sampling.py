"""How the AR stage draws its tokens: the folder's generation config, as ``generate`` reads it,
and the request's seed.

``GlmImagePipeline`` calls ``generate(do_sample=True)``: sampling with the model's generation
config, whose unset fields take transformers' defaults (temperature 1, top-k 50, top-p 1, no
repetition penalty). Those four shape the draw here (``row_sampling.RowPicker`` applies them in
``generate``'s order); a config that sets another logits processor ``generate`` would apply (a
minimum length, n-gram bans, suppressed tokens...) is refused at start rather than served
differently.
"""

from __future__ import annotations

from typing import Any

from omni_mesh.engines.base import EngineConfigError, EngineContext
from omni_mesh.engines.batching.row_sampling import Sampling
from omni_mesh.engines.fields import FieldReader

#: transformers' values for generation config fields left unset (``GenerationConfig.
#: _get_default_generation_params``), for the fields that shape a draw.
DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}

#: Fields whose set values would add a logits processor the stage does not apply, with the
#: values that add none.
UNSUPPORTED = {
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "typical_p": (None, 1.0),
    "min_p": (None,),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,),
    "renormalize_logits": (None, False),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
}

SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes 64-bit seeds


def generation_sampling(config: Any, ctx: EngineContext) -> Sampling:
    """The draw ``generate(do_sample=True)`` makes with generation config ``config``."""
    for name, neutral in UNSUPPORTED.items():
        if getattr(config, name, None) not in neutral:
            raise EngineConfigError(
                f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): the AR's generation config sets "
                f"{name}={getattr(config, name)!r}, which this stage does not apply"
            )
    values = {
        name: default if getattr(config, name, None) is None else getattr(config, name)
        for name, default in DEFAULTS.items()
    }
    return Sampling(
        do_sample=True,
        temperature=float(values["temperature"]),
        top_k=int(values["top_k"]),
        top_p=float(values["top_p"]),
        repetition_penalty=float(values["repetition_penalty"]),
    )


def check_seed(fields: FieldReader, seed: object) -> None:
    """The request's seed must be an integer a ``torch.Generator`` takes (its draws, and the
    DiT's noise, come from it)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fields.error("field", "seed", f"must be an integer, got {type(seed).__name__}")
    if not 0 <= seed < SEED_LIMIT:
        raise fields.error("field", "seed", f"must be in [0, 2**64), got {seed}")
