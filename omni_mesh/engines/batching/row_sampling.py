"""Token choice for a batched decode, row by row as transformers' ``generate`` makes it alone.

:class:`RowPicker` applies the logits processors ``generate`` builds for the same settings (in its
order: repetition penalty over the row's generated tokens, suppressed tokens, then, when
sampling, temperature, top-k, top-p), all of which work on each row of a ``[B, V]`` batch
independently, then picks each row's token: ``argmax``, or ``torch.multinomial`` on the row's
softmax with the row's own :class:`torch.Generator`. A row's draw thus consumes its generator
exactly as the monolithic ``generate`` of that request alone consumes the process RNG after
``torch.manual_seed(seed)`` (:func:`row_generator`), and never depends on its batchmates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """``generate``'s settings that shape one token choice (transformers' defaults: no-ops)."""

    do_sample: bool
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    suppress: tuple[int, ...] = ()


def row_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own RNG: the state ``torch.manual_seed(seed)`` gives the process RNG."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


class RowPicker:
    """Picks one token per row of a batch of logits (module docstring)."""

    def __init__(self, sampling: Sampling) -> None:
        from transformers import LogitsProcessorList
        from transformers.generation.logits_process import (
            RepetitionPenaltyLogitsProcessor,
            SuppressTokensLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.sampling = s = sampling
        processors = LogitsProcessorList()
        if s.repetition_penalty != 1.0:  # the conditions of GenerationMixin._get_logits_processor
            processors.append(RepetitionPenaltyLogitsProcessor(penalty=s.repetition_penalty))
        if s.suppress:
            processors.append(SuppressTokensLogitsProcessor(list(s.suppress)))
        if s.do_sample:
            if s.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(s.temperature))
            if s.top_k != 0:
                processors.append(TopKLogitsWarper(top_k=s.top_k, min_tokens_to_keep=1))
            if s.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1))
        self.processors = processors

    def pick(
        self,
        logits: Tensor,
        history: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator],
    ) -> list[int]:
        """One token per row of ``logits`` [B, V] (the last position's head output), each row
        penalised for its own ``history`` (its generated tokens) and drawn with its own
        generator."""
        scores = logits.to(copy=True, dtype=torch.float32)  # as generate's next_token_logits
        scores = self.processors(_padded(history, scores.shape[-1], scores.device), scores)
        if not self.sampling.do_sample:
            return [int(t) for t in torch.argmax(scores, dim=-1)]
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return [
            int(torch.multinomial(probs[i : i + 1], num_samples=1, generator=generator))
            for i, generator in enumerate(generators)
        ]


def _padded(history: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """The rows' generated tokens as one [B, n] id matrix, short rows padded with ``vocab``: the
    repetition penalty maps ids past the vocabulary to a column it drops, so a pad penalises
    nothing."""
    width = max((len(h) for h in history), default=0)
    ids = torch.full((len(history), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(history):
        if tokens:
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return ids.to(device)
