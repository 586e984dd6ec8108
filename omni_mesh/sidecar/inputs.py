"""Turning a client's prompt object into the entry stage's :class:`StageInput`."""

from __future__ import annotations

import re
import secrets
import time
import uuid

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.data_plane.messages import Payload, Prompt, SamplingParams, Scalar, StageInput

_OPTIONAL = (
    "seed",
    "voice",
    "max_tokens",
    "size",
    "steps",
    "width",
    "height",
    "guidance_scale",
    "partial_images",
)
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


class BadPrompt(ValueError):
    """The prompt object does not fit the pipeline; the message names the field."""


def new_request_id() -> str:
    return uuid.uuid4().hex


def entry_input(
    pipeline: PipelineSpec,
    prompt: Prompt,
    *,
    timeout_s: float,
    sampling: SamplingParams | None = None,
    traceparent: str = "",
) -> StageInput:
    """The entry stage's input; every optional prompt field must be one the pipeline takes."""
    fields: dict[str, Scalar] = {"prompt": prompt.prompt}
    for name in _OPTIONAL:
        value = getattr(prompt, name)
        if value is None:
            continue
        if name not in pipeline.prompt_fields:
            raise BadPrompt(
                f"stage_input.{name}: field not accepted by pipeline {pipeline.name!r} "
                f"(accepted: prompt, {', '.join(pipeline.prompt_fields)})"
            )
        if name != "seed":
            fields[name] = value
    seed = prompt.seed if prompt.seed is not None else secrets.randbits(31)
    return StageInput(
        pipeline=pipeline.name,
        request_id=prompt.request_id or new_request_id(),
        stage_id=pipeline.entry_stage_id,
        deadline_ms=int((time.time() + timeout_s) * 1000),
        seed=seed,
        traceparent=traceparent if _TRACEPARENT.fullmatch(traceparent) else "",
        sampling=sampling,
        payload=Payload(fields=fields),
    )
