"""A realtime session's configuration: what ``session.update`` sets, what ``session.created`` and
``session.updated`` show, and what the store keeps (:func:`to_builtins`/:func:`from_builtins`).

:func:`apply_update` checks an update against the pipeline before changing anything: a session
either takes the whole update or none of it (an ``error`` names the first field at fault).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec
from omni_mesh.sidecar.api.outputs import final_stage
from omni_mesh.sidecar.api.realtime.client_events import (
    AudioFormatIn,
    AudioIn,
    EventError,
    ResponseIn,
    SessionIn,
    TurnDetectionIn,
)

#: OpenAI's server_vad defaults.
DEFAULT_THRESHOLD = 0.5
DEFAULT_PREFIX_PADDING_MS = 300
DEFAULT_SILENCE_DURATION_MS = 500


class TurnDetection(Struct, omit_defaults=False):
    type: Literal["server_vad"] = "server_vad"
    threshold: float = DEFAULT_THRESHOLD
    prefix_padding_ms: int = DEFAULT_PREFIX_PADDING_MS
    silence_duration_ms: int = DEFAULT_SILENCE_DURATION_MS
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None


class SessionConfig(Struct):
    """The session's settings (the GA ``session`` object flattened)."""

    model: str
    output_modalities: list[str]
    instructions: str = ""
    input_format: str = "audio/pcm"
    turn_detection: TurnDetection | None = msgspec.field(default_factory=TurnDetection)
    output_format: str = "audio/pcm"
    voice: str | None = None
    speed: float = 1.0
    max_output_tokens: int | Literal["inf"] = "inf"


def default_config(pipeline: PipelineSpec) -> SessionConfig:
    """A new session: audio out when the pipeline makes audio, else text; server VAD on when the
    pipeline takes audio in (a text-only pipeline has nothing to detect)."""
    audio_out = final_stage(pipeline, OutputKind.AUDIO) is not None
    return SessionConfig(
        model=pipeline.name,
        output_modalities=["audio"] if audio_out else ["text"],
        turn_detection=TurnDetection() if pipeline.input_audio else None,
    )


def _format_type(fmt: AudioFormatIn) -> str:
    return fmt.type


def _turn_detection(td: TurnDetectionIn, current: TurnDetection | None) -> TurnDetection:
    at = "session.audio.input.turn_detection"
    if td.type == "semantic_vad":
        raise EventError(
            f"{at}.type: 'semantic_vad' is not served (server_vad, or null for manual commits)",
            param=f"{at}.type",
        )
    if td.eagerness is not None:
        raise EventError(f"{at}.eagerness: only for semantic_vad", param=f"{at}.eagerness")
    base = current or TurnDetection()
    return TurnDetection(
        threshold=base.threshold if td.threshold is None else td.threshold,
        prefix_padding_ms=(
            base.prefix_padding_ms if td.prefix_padding_ms is None else td.prefix_padding_ms
        ),
        silence_duration_ms=(
            base.silence_duration_ms if td.silence_duration_ms is None else td.silence_duration_ms
        ),
        create_response=base.create_response if td.create_response is None else td.create_response,
        interrupt_response=(
            base.interrupt_response if td.interrupt_response is None else td.interrupt_response
        ),
        idle_timeout_ms=base.idle_timeout_ms if td.idle_timeout_ms is None else td.idle_timeout_ms,
    )


def check_modalities(pipeline: PipelineSpec, modalities: Sequence[str], param: str) -> list[str]:
    """GA takes one of ``["text"]`` or ``["audio"]`` (audio comes with its transcript)."""
    if sorted(set(modalities)) not in (["text"], ["audio"]):
        raise EventError(f"{param}: give one of ['text'] or ['audio']", param=param)
    if modalities[0] == "audio" and final_stage(pipeline, OutputKind.AUDIO) is None:
        raise EventError(f"{param}: pipeline {pipeline.name!r} makes no audio", param=param)
    if modalities[0] == "text" and final_stage(pipeline, OutputKind.TEXT) is None:
        raise EventError(f"{param}: pipeline {pipeline.name!r} makes no text", param=param)
    return [modalities[0]]


def _refuse_unserved(update: SessionIn) -> None:
    if update.type == "transcription":
        raise EventError(
            "session.type: transcription sessions are not served ('realtime')",
            param="session.type",
        )
    if update.tools:
        raise EventError("session.tools: tools are not served", param="session.tools")
    if update.tool_choice not in (UNSET, "auto", "none"):
        raise EventError("session.tool_choice: tools are not served", param="session.tool_choice")
    if update.prompt not in (UNSET, None):
        raise EventError("session.prompt: prompt templates are not served", param="session.prompt")
    audio_in = update.audio.input if update.audio is not UNSET else UNSET
    if audio_in is not UNSET and audio_in.transcription not in (UNSET, None):
        raise EventError(
            "session.audio.input.transcription: input transcription is not served "
            "(the model hears the audio itself)",
            param="session.audio.input.transcription",
        )
    if audio_in is not UNSET and audio_in.noise_reduction not in (UNSET, None):
        raise EventError(
            "session.audio.input.noise_reduction: noise reduction is not served",
            param="session.audio.input.noise_reduction",
        )


def apply_update(pipeline: PipelineSpec, config: SessionConfig, update: SessionIn) -> SessionConfig:
    """``config`` with ``update`` applied (see the module docstring)."""
    _refuse_unserved(update)
    if update.model is not UNSET and update.model != pipeline.name:
        raise EventError(
            f"session.model: {update.model!r} is not served here ({pipeline.name!r})",
            param="session.model",
        )
    new = msgspec.structs.replace(config)
    if update.instructions is not UNSET:
        new.instructions = update.instructions
    if update.output_modalities is not UNSET:
        new.output_modalities = check_modalities(
            pipeline, update.output_modalities, "session.output_modalities"
        )
    if update.max_output_tokens is not UNSET:
        new.max_output_tokens = update.max_output_tokens
    if update.audio is not UNSET:
        _apply_audio(pipeline, config, new, update.audio)
    return new


def _apply_audio(
    pipeline: PipelineSpec, config: SessionConfig, new: SessionConfig, audio: AudioIn
) -> None:
    audio_in, audio_out = audio.input, audio.output
    if audio_in is not UNSET:
        if audio_in.format is not UNSET:
            new.input_format = _format_type(audio_in.format)
        if audio_in.turn_detection is None:
            new.turn_detection = None
        elif audio_in.turn_detection is not UNSET:
            if not pipeline.input_audio:
                raise EventError(
                    "session.audio.input.turn_detection: pipeline "
                    f"{pipeline.name!r} takes no audio input",
                    param="session.audio.input.turn_detection",
                )
            new.turn_detection = _turn_detection(audio_in.turn_detection, config.turn_detection)
    if audio_out is not UNSET:
        if audio_out.format is not UNSET:
            new.output_format = _format_type(audio_out.format)
        if audio_out.voice is not UNSET:
            if "voice" not in pipeline.prompt_fields:
                raise EventError(
                    f"session.audio.output.voice: pipeline {pipeline.name!r} has no voices",
                    param="session.audio.output.voice",
                )
            new.voice = audio_out.voice
        if audio_out.speed is not UNSET:  # the answer is time-stretched, pitch kept
            new.speed = audio_out.speed


def response_overrides(
    pipeline: PipelineSpec, config: SessionConfig, response: ResponseIn | None
) -> SessionConfig:
    """The configuration one ``response.create`` runs with (its overrides on the session's)."""
    if response is None:
        return config
    if response.tools:
        raise EventError("response.tools: tools are not served", param="response.tools")
    if response.conversation == "none" or response.input is not UNSET:
        raise EventError(
            "response.conversation: out-of-band responses are not served "
            "(responses use the session's conversation)",
            param="response.conversation" if response.input is UNSET else "response.input",
        )
    new = msgspec.structs.replace(config)
    if response.output_modalities is not UNSET:
        new.output_modalities = check_modalities(
            pipeline, response.output_modalities, "response.output_modalities"
        )
    if response.instructions is not UNSET:
        new.instructions = response.instructions
    if response.max_output_tokens is not UNSET:
        new.max_output_tokens = response.max_output_tokens
    return new


def _format_wire(fmt: str) -> dict[str, Any]:
    return {"type": fmt, "rate": 24000} if fmt == "audio/pcm" else {"type": fmt}


def session_object(session_id: str, config: SessionConfig) -> dict[str, Any]:
    """The GA ``session`` object of ``session.created``/``session.updated``."""
    td = None if config.turn_detection is None else msgspec.to_builtins(config.turn_detection)
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": config.model,
        "output_modalities": list(config.output_modalities),
        "instructions": config.instructions,
        "audio": {
            "input": {
                "format": _format_wire(config.input_format),
                "transcription": None,
                "noise_reduction": None,
                "turn_detection": td,
            },
            "output": {
                "format": _format_wire(config.output_format),
                "voice": config.voice,
                "speed": config.speed,
            },
        },
        "tools": [],
        "tool_choice": "auto",
        "max_output_tokens": config.max_output_tokens,
        "tracing": None,
        "prompt": None,
        "expires_at": 0,
        "include": None,
    }


def to_builtins(config: SessionConfig) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(config)
    return out


def from_builtins(raw: Any) -> SessionConfig:
    return msgspec.convert(raw, SessionConfig)
