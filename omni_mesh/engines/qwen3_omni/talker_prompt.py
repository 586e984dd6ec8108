"""The talker's prompt from the thinker's output, as Qwen3-Omni's monolithic ``generate`` builds it.

For a batch of one: the user turns' positions (their text embeddings through the talker's
``text_projection``, their audio/image/video positions' hidden states through
``hidden_projection``), then the assistant part (its first three embeddings, four tts_pad, tts_bos
and the first answer token, added to the codec specials nothink/think_bos/think_eos/speaker/
pad/bos), and the trailing text the talker consumes one entry per step (the rest of the answer,
then tts_eos). ``talker_input_ids`` (for the 3-D RoPE over audio positions) follow the same
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class TalkerPrompt:
    inputs_embeds: Tensor  # [1, L, H]
    talker_input_ids: Tensor  # [1, L]
    trailing_text_hidden: Tensor  # [1, T, H]
    tts_pad_embed: Tensor  # [1, 1, H]
    audio_feature_lengths: Tensor | None


def talker_prompt(
    talker: Any,
    config: Any,
    sequences: Tensor,
    prompt_tokens: int,
    thinker_embed: Tensor,
    thinker_hidden: Tensor,
    tts_special: Tensor,
    speaker_id: int,
    audio_feature_lengths: Tensor | None,
) -> TalkerPrompt:
    """The talker's inputs (module docstring); tensors are the thinker's, batch dim added here,
    all on the talker's device."""
    tc = config.talker_config
    dtype, device = talker.dtype, talker.device
    sequences, thinker_embed = sequences.to(device), thinker_embed.to(device)
    thinker_hidden, tts_special = thinker_hidden.to(device), tts_special.to(device)
    seq = sequences[None]
    embed = thinker_embed[None].to(dtype)
    hidden = thinker_hidden[None].to(dtype)
    input_ids = seq[:, :prompt_tokens]
    mm_ids = torch.tensor(
        [tc.audio_token_id, tc.image_token_id, tc.video_token_id], dtype=seq.dtype, device=device
    )
    multimodal = torch.isin(seq, mm_ids)

    # user turns: every position whose last <|im_start|> is followed by the user role token
    positions = torch.arange(prompt_tokens, device=device)[None]
    im_start = torch.where(input_ids == config.im_start_token_id, positions, -1)
    previous = torch.cummax(im_start, dim=-1).values.clamp_min(0)
    roles = input_ids.gather(1, (previous + 1).clamp_max(prompt_tokens - 1))
    user = (roles == config.user_token_id)[0]
    user_part = torch.empty(
        (1, prompt_tokens, tc.text_config.hidden_size), dtype=dtype, device=device
    )
    mm = multimodal[:, :prompt_tokens]
    if mm.any():
        user_part[mm] = talker.hidden_projection(hidden[:, :prompt_tokens][mm])
    user_part[~mm] = talker.text_projection(embed[:, :prompt_tokens][~mm])
    user_embeds = user_part[:, user]
    user_ids = input_ids[:, user]

    starts = (input_ids[0, :-1] == config.im_start_token_id) & (
        input_ids[0, 1:] == config.assistant_token_id
    )
    start = int(torch.nonzero(starts).flatten()[-1])
    bos, eos, pad = talker.text_projection(tts_special[None].to(dtype)).chunk(3, dim=1)
    assistant = talker.text_projection(embed[:, start : seq.shape[1]])
    text_part = torch.cat((assistant[:, :3], pad.expand(1, 4, -1), bos, assistant[:, 3:4]), dim=1)
    codec_ids = torch.tensor(
        [
            [
                tc.codec_nothink_id,
                tc.codec_think_bos_id,
                tc.codec_think_eos_id,
                speaker_id,
                tc.codec_pad_id,
                tc.codec_bos_id,
            ]
        ],
        device=device,
    )
    codec_part = torch.cat(
        (
            torch.zeros((1, 3, tc.text_config.hidden_size), dtype=dtype, device=device),
            talker.get_input_embeddings()(codec_ids),
        ),
        dim=1,
    )
    trailing = torch.cat((assistant[:, 4:], eos), dim=1)
    trailing = _end_at_first_eos(trailing, seq[0, prompt_tokens:], config.im_end_token_id, eos, pad)
    assistant_ids = torch.full(
        (1, text_part.shape[1]), config.tts_pad_token_id, dtype=torch.long, device=device
    )
    return TalkerPrompt(
        inputs_embeds=torch.cat((user_embeds, text_part + codec_part), dim=1),
        talker_input_ids=torch.cat((user_ids, assistant_ids), dim=1),
        trailing_text_hidden=trailing,
        tts_pad_embed=pad,
        audio_feature_lengths=(
            None if audio_feature_lengths is None else audio_feature_lengths.to(device)
        ),
    )


def _end_at_first_eos(
    trailing: Tensor, generated: Tensor, eos_id: int, eos: Tensor, pad: Tensor
) -> Tensor:
    """tts_eos right after the answer's first <|im_end|>, tts_pad after it (entry j holds
    generated token j + 1), as the monolithic generate does for every row of a batch."""
    hits = torch.nonzero(generated == eos_id).flatten()
    first = int(hits[0]) if len(hits) else len(generated)
    index = torch.arange(trailing.shape[1], device=trailing.device)[None, :, None]
    trailing = torch.where(index > first, pad.to(trailing.dtype), trailing)
    return torch.where(index == first, eos.to(trailing.dtype), trailing)
