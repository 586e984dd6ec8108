"""What the text routes (``/v1/completions``, ``/v1/chat/completions``) share with vLLM's own
OpenAI server: the request's sampling params (checked, a 400 naming the field), and the answer's
``finish_reason``, ``usage`` and ``logprobs`` read from the text stage's final fields.

A vLLM stage's final text output carries ``finish_reason`` (``stop``/``length``),
``prompt_tokens`` and ``completion_tokens`` on its last chunk, and the tokens' logprobs (when
asked; ``text_logprobs.py`` shapes them); reference engines carry none of them (``stop``,
usage 0, null logprobs). With ``n`` choices, ``usage`` counts the prompt once and sums the
choices' tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.sidecar.api.outputs import FinalOutput
from omni_mesh.sidecar.errors import bad_request

_FIELD = re.compile(r"`\$\.(\w+)")
#: The request fields that are sampling params (the same names in both routes).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "ignore_eos")


def sampling_from(
    req: Any, *, max_tokens: int | None, logprobs: int | None
) -> SamplingParams | None:
    """The request's sampling params (only what it sets; None when it sets nothing), checked
    against :class:`SamplingParams`' bounds: a bad value is a 400 naming the field."""
    values: dict[str, Any] = {k: getattr(req, k) for k in _SAMPLING_FIELDS}
    stop = req.stop
    values["stop"] = [stop] if isinstance(stop, str) else stop
    values["max_tokens"] = max_tokens
    values["logprobs"] = logprobs
    values = {k: v for k, v in values.items() if v is not None}
    if not values:
        return None
    try:
        return msgspec.convert(values, SamplingParams)
    except msgspec.ValidationError as exc:
        where = _FIELD.search(str(exc))
        raise bad_request(f"invalid sampling params: {exc}", where and where[1]) from None


def finish_reason(text: FinalOutput | None) -> str:
    """``stop`` (the model ended or a stop string matched) or ``length`` (max_tokens)."""
    fields = (text.fields or {}) if text is not None else {}
    reason = fields.get("finish_reason")
    return reason if isinstance(reason, str) and reason else "stop"


def usage(text: FinalOutput | None) -> dict[str, int]:
    """OpenAI's ``usage`` from the text stage's token counts (0 where the engine has none)."""
    fields = (text.fields or {}) if text is not None else {}
    prompt = fields.get("prompt_tokens")
    completion = fields.get("completion_tokens")
    p = prompt if isinstance(prompt, int) else 0
    c = completion if isinstance(completion, int) else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def usage_of(choices: Sequence[FinalOutput | None]) -> dict[str, int]:
    """``usage`` of n choices of one prompt: its tokens once, the choices' tokens summed."""
    each = [usage(c) for c in choices] or [usage(None)]
    p = each[0]["prompt_tokens"]
    c = sum(u["completion_tokens"] for u in each)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
