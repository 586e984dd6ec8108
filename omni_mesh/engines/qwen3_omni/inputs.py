"""The thinker's prompt: chat messages (text and audio parts) → token ids and audio features.

The chat route hands the whole conversation over as the ``messages`` field (JSON text); the
other routes give a ``prompt`` (one user message). A content part may be OpenAI's
``{"type": "input_audio", "input_audio": {"data": <base64 WAV>, "format": "wav"}}``: the WAV
(PCM 8/16/32-bit, any rate, mono or several channels averaged) is resampled to the feature
extractor's rate (16 kHz, linear interpolation) and becomes one audio placeholder in the chat
template, expanded to as many audio tokens as the audio encoder yields for it, as Qwen3-Omni's
processor does. Every problem is an :class:`EngineInputError` naming the message and part.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import wave
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.engines.base import EngineInputError
from omni_mesh.engines.fields import FieldReader

MAX_AUDIO_SECONDS = 300.0
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Conversation:
    """Messages in the chat template's shape plus the audio of their audio parts, in order."""

    messages: list[dict[str, Any]]
    audios: list[np.ndarray]  # float32 mono at the feature extractor's rate


def conversation(
    where: str, messages_json: str | None, prompt: str | None, rate: int
) -> Conversation:
    """The request's conversation: ``messages`` when given, else ``prompt`` as one user turn."""
    if messages_json is None:
        if not prompt:
            raise EngineInputError(f"{where}: field 'prompt' (or 'messages') is required")
        return Conversation([{"role": "user", "content": prompt}], [])
    try:
        raw = json.loads(messages_json)
    except json.JSONDecodeError as exc:
        raise EngineInputError(f"{where}: field 'messages' is not JSON ({exc})") from None
    if not isinstance(raw, list) or not raw:
        raise EngineInputError(f"{where}: field 'messages' must be a non-empty list")
    messages: list[dict[str, Any]] = []
    audios: list[np.ndarray] = []
    for i, message in enumerate(raw):
        at = f"{where}: messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in (*ROLES, "developer"):
            raise EngineInputError(f"{at}: needs a role among {', '.join(ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        content = message.get("content")
        if content is None or isinstance(content, str):
            messages.append({"role": role, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise EngineInputError(f"{at}.content must be a string or a list of parts")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            parts.append(_part(f"{at}.content[{j}]", part, rate, audios))
        messages.append({"role": role, "content": parts})
    return Conversation(messages, audios)


def _part(at: str, part: Any, rate: int, audios: list[np.ndarray]) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise EngineInputError(f"{at}: a text part needs a string 'text'")
        return {"type": "text", "text": text}
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
            raise EngineInputError(f"{at}: input_audio needs base64 'data'")
        if audio.get("format", "wav") != "wav":
            raise EngineInputError(f"{at}: input_audio format {audio.get('format')!r}: only wav")
        audios.append(decode_wav(at, audio["data"], rate))
        return {"type": "audio"}
    raise EngineInputError(f"{at}: part type {kind!r} is not served (text, input_audio)")


def decode_wav(at: str, data_b64: str, rate: int) -> np.ndarray:
    """Base64 WAV → float32 mono at ``rate`` Hz."""
    try:
        raw = base64.b64decode(data_b64, validate=True)
    except (binascii.Error, ValueError):
        raise EngineInputError(f"{at}: input_audio data is not base64") from None
    try:
        with wave.open(io.BytesIO(raw)) as w:
            width, channels, source_rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise EngineInputError(f"{at}: input_audio is not a PCM WAV file ({exc})") from None
    dtypes = {1: np.uint8, 2: np.int16, 4: np.int32}
    if width not in dtypes or source_rate <= 0 or channels < 1:
        raise EngineInputError(f"{at}: input_audio WAV must be 8, 16 or 32-bit PCM")
    pcm = np.frombuffer(frames, dtypes[width]).astype(np.float32)
    pcm = (pcm - 128.0) / 128.0 if width == 1 else pcm / float(2 ** (8 * width - 1))
    pcm = pcm[: len(pcm) - len(pcm) % channels].reshape(-1, channels).mean(axis=1)
    if len(pcm) == 0:
        raise EngineInputError(f"{at}: input_audio holds no samples")
    if len(pcm) / source_rate > MAX_AUDIO_SECONDS:
        raise EngineInputError(f"{at}: input_audio is longer than {MAX_AUDIO_SECONDS:.0f} s")
    return resample(pcm, source_rate, rate)


def resample(pcm: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    if source_rate == rate:
        return pcm.astype(np.float32)
    n = max(1, round(len(pcm) * rate / source_rate))
    positions = np.arange(n, dtype=np.float64) * (source_rate / rate)
    out: np.ndarray = np.interp(positions, np.arange(len(pcm)), pcm).astype(np.float32)
    return out


@dataclass
class ThinkerPrompt:
    """Tensors for ``thinker.generate`` (batch of one)."""

    input_ids: Any  # torch.LongTensor [1, P]
    attention_mask: Any
    input_features: Any | None  # [A, mels, frames] when there is audio
    feature_attention_mask: Any | None


def thinker_prompt(tokenizer: Any, feature_extractor: Any, conv: Conversation) -> ThinkerPrompt:
    """Tokenise ``conv`` with the folder's chat template, audio tokens expanded (module doc)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    text = tokenizer.apply_chat_template(conv.messages, add_generation_prompt=True, tokenize=False)
    features = None
    feature_mask = None
    if conv.audios:
        check_audio_lengths(conv.audios, feature_extractor)
        features, feature_mask = audio_features(conv.audios, feature_extractor)
        lengths = _get_feat_extract_output_lengths(feature_mask.sum(-1)).tolist()
        token = tokenizer.audio_token
        pieces = text.split(token)
        if len(pieces) != len(lengths) + 1:
            raise EngineInputError(
                f"chat template placed {len(pieces) - 1} audio tokens for {len(lengths)} audios"
            )
        text = pieces[0] + "".join(
            token * int(n) + piece for n, piece in zip(lengths, pieces[1:], strict=True)
        )
    encoded = tokenizer(text, return_tensors="pt")
    return ThinkerPrompt(encoded["input_ids"], encoded["attention_mask"], features, feature_mask)


def request_conversation(fields: FieldReader, rate: int) -> Conversation:
    """The conversation of a request's ``messages`` (JSON text) or ``prompt`` field."""
    messages = fields.data.fields.get("messages")
    prompt = fields.data.fields.get("prompt")
    return conversation(
        fields.where,
        messages if isinstance(messages, str) else None,
        prompt if isinstance(prompt, str) else None,
        rate,
    )


def answer_tokens(
    fields: FieldReader, sampling: SamplingParams | None, default: int, limit: int
) -> int:
    """Most tokens the thinker may answer with: the request's ``max_tokens`` (field or sampling
    param, the smaller), else ``default``; more than ``limit`` names the field."""
    requested = fields.optional_int("max_tokens", None, 1, 1 << 20)
    if sampling is not None and sampling.max_tokens is not None:
        requested = min(requested or sampling.max_tokens, sampling.max_tokens)
    max_tokens = requested or default
    if max_tokens > limit:
        raise fields.error(
            "field",
            "max_tokens",
            f"is {max_tokens}; this stage generates at most {limit} "
            "(engine_extras.max_tokens_limit)",
        )
    return max_tokens


def check_audio_lengths(audios: list[np.ndarray], feature_extractor: Any) -> None:
    """Every audio long enough for the audio encoder (one window of the feature extractor)."""
    if audios and min(len(a) for a in audios) < feature_extractor.n_fft:
        raise EngineInputError(
            f"an input_audio holds {min(len(a) for a in audios)} samples at "
            f"{feature_extractor.sampling_rate} Hz; the audio encoder needs at least "
            f"{feature_extractor.n_fft}"
        )


def audio_features(audios: list[np.ndarray], feature_extractor: Any) -> Any:
    """(features, attention mask) of the audios, padded to the longest, as Qwen3-Omni's
    processor makes them (no 30 s cut); a row's mask sums to its frames."""
    extracted = feature_extractor(
        audios,
        sampling_rate=feature_extractor.sampling_rate,
        padding=True,
        truncation=False,  # as Qwen3-Omni's processor: no 30 s cut
        return_attention_mask=True,
        return_tensors="pt",
    )
    return extracted["input_features"], extracted["attention_mask"]
