"""Processor of the csm-tts pipeline: the talker's codes → code2wav's input. It passes what
code2wav reads and nothing else."""

from __future__ import annotations

from omni_mesh.engines.base import EngineInputError, StageData


def talker_to_code2wav(data: StageData) -> StageData:
    """``codes`` [F, G] and, on a stream's later chunks, ``context_codes`` [M, G]."""
    if "codes" not in data.arrays:
        raise EngineInputError("processor talker_to_code2wav: upstream output lacks 'codes'")
    arrays = {"codes": data.arrays["codes"]}
    if "context_codes" in data.arrays:
        arrays["context_codes"] = data.arrays["context_codes"]
    return StageData(arrays=arrays)
