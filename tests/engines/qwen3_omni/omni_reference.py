"""The monolithic Qwen3-Omni answer a served request must equal, and reading the served one."""

from __future__ import annotations

import base64
import io
import json
import wave
from functools import cache
from typing import Any

import numpy as np
import torch

from omni_mesh.data_plane import media
from omni_mesh.engines.hf.folders import resolve_folder
from omni_mesh.engines.qwen3_omni.inputs import conversation, thinker_prompt

TALKER_FRAMES = 64  # the bundled deploy config's talker max_frames


@cache
def monolithic() -> Any:
    from transformers import AutoFeatureExtractor, AutoTokenizer
    from transformers import Qwen3OmniMoeForConditionalGeneration as Full

    folder = str(resolve_folder("tiny-qwen3-omni"))
    model = Full.from_pretrained(folder).eval()
    model.tokenizer = AutoTokenizer.from_pretrained(folder)
    model.features = AutoFeatureExtractor.from_pretrained(folder)
    return model


def reference_prompt(model: Any, messages: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
    """The thinker's prompt tensors for ``messages`` and the audio keyword arguments
    ``generate`` takes with them (none without audio)."""
    prompt = thinker_prompt(
        model.tokenizer, model.features, conversation("ref", json.dumps(messages), None, 16000)
    )
    extra: dict[str, Any] = {}
    if prompt.input_features is not None:
        extra = {
            "input_features": prompt.input_features,
            "feature_attention_mask": prompt.feature_attention_mask,
        }
    return prompt, extra


def generate_whole(
    model: Any,
    messages: list[dict[str, Any]],
    *,
    seed: int,
    max_tokens: int,
    frames: int,
    sample_talker: bool,
) -> tuple[int, np.ndarray, np.ndarray]:
    """(prompt tokens, sequences, waveform) of transformers' own ``generate`` of the whole
    model after ``torch.manual_seed(seed)``: thinker greedy, the talker as asked."""
    prompt, extra = reference_prompt(model, messages)
    torch.manual_seed(seed)
    with torch.inference_mode():
        sequences, wav = model.generate(
            input_ids=prompt.input_ids,
            attention_mask=prompt.attention_mask,
            thinker_max_new_tokens=max_tokens,
            thinker_eos_token_id=model.config.im_end_token_id,
            talker_max_new_tokens=frames,
            talker_do_sample=sample_talker,
            speaker="ethan",
            **extra,
        )
    return int(prompt.input_ids.shape[1]), sequences[0].numpy(), wav.reshape(-1).numpy()


def monolithic_codes(
    model: Any,
    messages: list[dict[str, Any]],
    *,
    seed: int,
    max_tokens: int,
    frames: int,
    sample_talker: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`generate_whole`'s (sequences, codes [F, G], waveform), the codes read off the
    talker's forward outputs as the monolithic generate itself collects them."""
    codes: list[np.ndarray] = []

    def grab(module: Any, args: Any, output: Any) -> None:
        if output.hidden_states[1] is not None:
            codes.append(output.hidden_states[1][0].numpy())

    hook = model.talker.register_forward_hook(grab)
    try:
        _, sequences, wav = generate_whole(
            model,
            messages,
            seed=seed,
            max_tokens=max_tokens,
            frames=frames,
            sample_talker=sample_talker,
        )
    finally:
        hook.remove()
    return sequences, np.stack(codes), wav


def expected(messages: list[dict[str, Any]], seed: int, max_tokens: int) -> tuple[str, np.ndarray]:
    """(text, PCM16 samples) of the monolithic model with the deploy config's talker defaults
    (sampled, ``TALKER_FRAMES``)."""
    model = monolithic()
    n, sequences, wav = generate_whole(
        model, messages, seed=seed, max_tokens=max_tokens, frames=TALKER_FRAMES, sample_talker=True
    )
    text = model.tokenizer.decode(sequences[n:], skip_special_tokens=True)
    pcm = np.frombuffer(media.pcm_bytes(wav), np.int16)
    return text, pcm


def wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1
        return np.frombuffer(w.readframes(w.getnframes()), np.int16)


def wav_b64(samples: np.ndarray, rate: int) -> str:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype(np.int16).tobytes())
    return base64.b64encode(out.getvalue()).decode()


TONE = (np.sin(np.arange(22050) / 22050 * 2 * np.pi * 300) * 0.4).astype(np.float32)


def audio_messages() -> list[dict[str, Any]]:
    audio = {"data": wav_b64(TONE, 22050), "format": "wav"}
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_audio", "input_audio": audio},
                {"type": "text", "text": "what is this sound?"},
            ],
        }
    ]


#: (messages, thinker max_tokens): prompts and answers of different lengths
CHATS: list[tuple[list[dict[str, Any]], int]] = [
    ([{"role": "user", "content": "hello, who are you?"}], 6),
    (audio_messages(), 10),
    (
        [
            {"role": "system", "content": "you are a helpful robot that tells long stories"},
            {"role": "user", "content": "tell me a story about the quick brown fox"},
        ],
        14,
    ),
    ([{"role": "user", "content": "count to ten"}], 3),
]


def sdk_chat(
    sdk: Any, messages: list[dict[str, Any]], seed: int, max_tokens: int = 8
) -> tuple[str, np.ndarray]:
    """(text, PCM16 samples) of a qwen3-omni chat with text and audio out, through the
    ``openai`` client ``sdk``."""
    out = sdk.chat.completions.create(
        model="qwen3-omni",
        messages=messages,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        seed=seed,
        max_tokens=max_tokens,
    )
    message = out.choices[0].message
    assert message.audio is not None and message.content is not None
    return message.content, wav_samples(base64.b64decode(message.audio.data))


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    """The same samples but for one step of rounding (a streamed decode differs from the
    whole one by ~1e-14)."""
    assert got.shape == want.shape
    assert int(np.abs(got.astype(np.int32) - want.astype(np.int32)).max()) <= 1
