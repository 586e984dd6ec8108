"""The text the talker reads while the thinker is still answering (a streamed input: the
talker's spec has ``stream_input``, the thinker hands its positions on in chunks).

Qwen3-Omni's talker adds one entry of ``trailing_text_hidden`` to each frame's input after its
prompt: entry ``j`` is the thinker's input embedding of answer token ``j + 1`` through the
talker's ``text_projection``, tts_eos once the answer is spoken, tts_pad after it
(``talker_prompt``). Entry ``j`` can thus be had as soon as the thinker has fed answer token
``j + 1``: :meth:`StreamedText.entry` gives it then (None before: the talker's row waits,
parked, while the others decode). Once the whole answer is in, the entries come from the
whole-answer computation itself (``talker_prompt``), so the end of the text (tts_eos where the
answer stopped, tts_pad after it) is what the whole hand-off reads. An entry made early goes
through ``text_projection`` alone rather than with the whole answer's rows: equal values up to
the last float bits of a matmul of another shape, which the codes do not depend on (the batched
decode's argument, ``talker_batch``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_mesh.engines.base import EngineRequest


class StreamedText:
    """The trailing text entries of one streamed request (module docstring)."""

    def __init__(
        self,
        talker: Any,
        request: EngineRequest,
        prompt_tokens: int,
        im_end: int,
        whole: Callable[[], tuple[Tensor, Tensor]],
    ) -> None:
        """``whole()`` gives (trailing_text_hidden [1, T, H], tts_pad_embed [1, 1, H]) of the
        complete answer, as the whole hand-off's prompt has them."""
        self.talker = talker
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.im_end = im_end
        self._whole = whole
        self._complete: tuple[Tensor, Tensor] | None = None
        self._made: dict[int, Tensor] = {}

    def available(self, j: int) -> bool:
        """Whether entry ``j`` can be had now (no compute: what came so far)."""
        if self.request.last:
            return True
        arrays = self.request.data.arrays
        position = self.prompt_tokens + 1 + j  # answer token j + 1
        if position >= arrays["thinker_embed"].shape[0]:
            return False
        # an answer that went on past its end: wait for the whole of it
        return not np.any(arrays["sequences"][self.prompt_tokens : position + 1] == self.im_end)

    def entry(self, j: int) -> Tensor | None:
        """Entry ``j`` ([1, 1, H]), or None while its position has not come."""
        if self.request.last:
            if self._complete is None:
                self._complete = self._whole()
                self._made.clear()
            trailing, pad = self._complete
            return trailing[:, j].unsqueeze(1) if j < trailing.shape[1] else pad
        made = self._made.get(j)
        if made is not None:
            return made
        if not self.available(j):
            return None
        embed = self.request.data.arrays["thinker_embed"]
        position = self.prompt_tokens + 1 + j
        talker = self.talker
        row = torch.from_numpy(np.array(embed[position : position + 1], dtype=np.float32))
        projected: Tensor = talker.text_projection(row.to(talker.device, talker.dtype)[None])
        self._made = {j: projected}  # asked again by the step that uses it
        return projected
