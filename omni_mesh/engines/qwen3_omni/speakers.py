"""The ``voice`` field of the real-architecture pipelines: a speaker of the model's config.

``voice`` names a speaker of the folder (Qwen3-Omni's ``talker_config.speaker_id``, e.g.
``ethan``), case-insensitive; unset or ``default`` is the monolithic ``generate``'s default
speaker (``ethan``) when the model has it, else its first.
OpenAI's voice names are not the model's speakers: asking for one is a 400 listing the real ones.
"""

from __future__ import annotations

from collections.abc import Mapping

from omni_mesh.engines.fields import FieldReader

DEFAULT_SPEAKER = "ethan"


def speaker_name(fields: FieldReader, speakers: Mapping[str, int] | None) -> str:
    """The lower-case speaker the request's ``voice`` names (module docstring)."""
    names = list(speakers or {})
    if not names:
        raise fields.error("config", "speaker_id", "lists no speakers")
    voice = fields.optional_str("voice", "default").lower()
    if voice == "default":
        return DEFAULT_SPEAKER if DEFAULT_SPEAKER in names else names[0]
    if voice not in names:
        raise fields.error(
            "field", "voice", f"names unknown voice {voice!r}; allowed: default, {', '.join(names)}"
        )
    return voice
