"""Processors of the qwen3-omni pipeline: the thinker's output → the talker's input, the
talker's codes → code2wav's. Each passes what the next stage reads and nothing else."""

from __future__ import annotations

from omni_mesh.engines.base import EngineInputError, StageData
from omni_mesh.engines.fields import passthrough

_TALKER_ARRAYS = ("sequences", "thinker_embed", "thinker_hidden", "tts_special")


def thinker_to_talker(data: StageData) -> StageData:
    """The token ids, the input embeddings and accept-layer hidden states, the tts special
    embeddings (and audio feature lengths, with audio input); ``prompt_tokens`` and ``voice``."""
    arrays = {}
    for name in _TALKER_ARRAYS:
        if name not in data.arrays:
            raise EngineInputError(f"processor thinker_to_talker: upstream output lacks {name!r}")
        arrays[name] = data.arrays[name]
    if "audio_feature_lengths" in data.arrays:
        arrays["audio_feature_lengths"] = data.arrays["audio_feature_lengths"]
    return StageData(fields=passthrough(data, ("prompt_tokens", "voice")), arrays=arrays)


def talker_to_code2wav(data: StageData) -> StageData:
    """``codes`` [F, G] and, on a stream's later chunks, ``context_codes`` [M, G]."""
    if "codes" not in data.arrays:
        raise EngineInputError("processor talker_to_code2wav: upstream output lacks 'codes'")
    arrays = {"codes": data.arrays["codes"]}
    if "context_codes" in data.arrays:
        arrays["context_codes"] = data.arrays["context_codes"]
    return StageData(arrays=arrays)
