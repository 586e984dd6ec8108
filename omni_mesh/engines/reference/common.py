"""What the reference engines share besides :class:`~omni_mesh.engines.torch_engine.TorchEngine`:
the voices, the default sampling and tensors over received arrays."""

from __future__ import annotations

import numpy as np
import torch

from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.engines.fields import FieldReader
from omni_mesh.engines.moved import moved_name

#: Speaker voices of the talker (OpenAI's classic names plus "default"); the thinker checks a
#: ``voice`` field against them too, so a bad voice fails before any compute is spent.
VOICES = ("default", "alloy", "echo", "fable", "onyx", "nova", "shimmer")


def voice_index(fields: FieldReader) -> int:
    """Index in :data:`VOICES` of the ``voice`` field (case-insensitive; default "default")."""
    voice = fields.optional_str("voice", "default")
    if voice.lower() not in VOICES:
        raise fields.error(
            "field", "voice", f"names unknown voice {voice!r}; allowed: {', '.join(VOICES)}"
        )
    return VOICES.index(voice.lower())


def as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch view of ``arr``; a copy when it is read-only (backed by a received buffer) or not
    C-contiguous."""
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = np.array(arr, order="C")
    return torch.from_numpy(arr)


#: The reference engines' sampling when a request leaves it unset.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 0  # off


def sampling_or_default(sampling: SamplingParams | None) -> SamplingParams:
    return sampling if sampling is not None else SamplingParams()


def temperature_top_k(
    sampling: SamplingParams | None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int = DEFAULT_TOP_K,
) -> tuple[float, int]:
    """The request's temperature and top_k, each falling back to the given default when unset."""
    if sampling is None:
        return temperature, top_k
    return (
        temperature if sampling.temperature is None else sampling.temperature,
        top_k if sampling.top_k is None else sampling.top_k,
    )


#: What this module held before the engines' shared parts got modules of their own (issue 32).
_MOVED = {
    "ReferenceEngine": ("omni_mesh.engines.torch_engine", "TorchEngine"),
    "passthrough": ("omni_mesh.engines.fields", "passthrough"),
    "DEFAULT_MAX_PROMPT_BYTES": ("omni_mesh.engines.fields", "DEFAULT_MAX_PROMPT_BYTES"),
    "extra_int": ("omni_mesh.engines.extras", "extra_int"),
    "extra_float": ("omni_mesh.engines.extras", "extra_float"),
}


def __getattr__(name: str) -> object:
    return moved_name(__name__, name, _MOVED)
