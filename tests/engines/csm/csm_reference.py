"""The monolithic CSM answer a served request must equal: transformers'
``CsmForConditionalGeneration.generate(..., output_audio=True)`` on the tiny-csm folder."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import torch

from omni_mesh.data_plane import media
from omni_mesh.engines.hf.folders import resolve_folder

TALKER_FRAMES = 64  # the bundled deploy config's talker max_frames
#: CSM's sampling (the folder's generation config), passed explicitly: ``generate`` writes the
#: ``depth_decoder_*`` arguments of a call into the depth decoder's generation config for good.
SAMPLED = {
    "do_sample": True,
    "temperature": 0.9,
    "top_k": 50,
    "depth_decoder_do_sample": True,
    "depth_decoder_temperature": 0.9,
    "depth_decoder_top_k": 50,
}
GREEDY = {"do_sample": False, "depth_decoder_do_sample": False}


@cache
def monolithic() -> Any:
    from transformers import AutoProcessor, CsmForConditionalGeneration

    folder = str(resolve_folder("tiny-csm"))
    model = CsmForConditionalGeneration.from_pretrained(folder).eval()
    model.processor = AutoProcessor.from_pretrained(folder)
    return model


def generate(
    text: str, *, speaker: int, seed: int, frames: int, sampled: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(codes [F, G], waveform float32) of the monolithic generate after torch.manual_seed(seed),
    the codes cut where its audio decode cuts them (the first all-EOS frame)."""
    model = monolithic()
    conversation = [{"role": str(speaker), "content": [{"type": "text", "text": text}]}]
    inputs = model.processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            output_audio=True,
            return_dict_in_generate=True,
            max_new_tokens=frames,
            **(SAMPLED if sampled else GREEDY),
        )
    codes = out.sequences[0].numpy()
    ends = np.flatnonzero((codes == model.config.codebook_eos_token_id).all(axis=1))
    if len(ends):
        codes = codes[: int(ends[0])]
    return codes, out.audio[0].numpy()


def expected_pcm(text: str, speaker: int, seed: int) -> np.ndarray:
    """PCM16 samples of the monolithic model with the bundled deploy config's sampling."""
    _, wave = generate(text, speaker=speaker, seed=seed, frames=TALKER_FRAMES, sampled=True)
    return np.frombuffer(media.pcm_bytes(wave), np.int16)
