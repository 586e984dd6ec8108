"""Running a client request: its entry-stage input, its answer frames, their final outputs.

A request runs as :func:`request_frames`: the orchestrated path from the entry stage on, as
:class:`HopResult` frames (one frame when nothing streams). :func:`collect` joins them into the
final outputs (the unary routes); ``sinks.respond`` streams them to the client. Leaving early
(the client went away) closes the frame iterator, which aborts the request upstream.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

import msgspec
from aiohttp import web

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec
from omni_mesh.data_plane.messages import HopResult, Prompt, SamplingParams, StageInput
from omni_mesh.observability.tracing import LateAttributes, stage_span
from omni_mesh.sidecar.admission.admit import admitted
from omni_mesh.sidecar.admission.facts import admission_facts
from omni_mesh.sidecar.admission.outcomes import counted
from omni_mesh.sidecar.api.affinity_keys import affinity_key
from omni_mesh.sidecar.api.outputs import (
    ChunkAssembler,
    FinalOutput,
    final_stage,
    joined_off_loop,
)
from omni_mesh.sidecar.api.usage import Usage
from omni_mesh.sidecar.errors import bad_request, from_stage_error
from omni_mesh.sidecar.inputs import BadPrompt, entry_input
from omni_mesh.sidecar.pod import Pod


def entry(
    pod: Pod,
    request: web.Request,
    prompt: Prompt,
    sampling: SamplingParams | None = None,
    *,
    param: str | None = None,
    affinity: str | None = None,
) -> StageInput:
    """The entry stage's input for a client request (a bad prompt → 400 naming ``param``),
    with its priority class, tenant and session affinity (its ``X-Omni-Session`` header, else
    the route's ``affinity``: ``affinity_keys.py``): the one entry step of the API routes and
    of ``/v1/run`` on the entry stage."""
    facts = admission_facts(pod, request)  # read by the shed check already, or now
    priority, tenant, timeout_s = facts.resolve(pod, request.path, prompt.priority)
    try:
        si = entry_input(
            pod.pipeline,
            prompt,
            timeout_s=timeout_s,
            sampling=sampling,
            traceparent=request.headers.get("traceparent", ""),
        )
    except BadPrompt as exc:
        raise bad_request(str(exc), param) from None
    key = affinity_key(request, affinity)
    return msgspec.structs.replace(si, priority=priority, tenant=tenant, affinity=key)


async def request_frames(
    pod: Pod,
    request: web.Request,
    si: StageInput,
    late: LateAttributes | None = None,
    usage: Usage | None = None,
) -> AsyncGenerator[HopResult, None]:
    """The answer frames of ``si``: run here when this pod runs the entry stage, else handed to
    a replica of it. Admitted (counted, so a drain waits for it) until the iterator closes. The
    request's span ends with ``late``'s attributes (a streamed answer's audio figures); its
    usage is tallied into ``usage`` (a fresh one if None) and recorded when it ends."""
    if usage is None:
        usage = Usage()
    if usage.audio_stage is None:
        usage.audio_stage = final_stage(pod.pipeline, OutputKind.AUDIO)
    attributes = {"omni.request_id": si.request_id, "omni.pipeline": pod.pipeline.name}
    name = f"{request.method} {request.path}"
    try:
        with stage_span(name, si.traceparent, attributes, late) as tp:
            si = msgspec.structs.replace(si, traceparent=tp)
            async with admitted(pod, si.request_id, "api", si):
                if pod.runner is None or pod.stage_id != pod.pipeline.entry_stage_id:
                    async with contextlib.aclosing(pod.hop.stream(si)) as stream:
                        async for frame in stream:
                            usage.add(frame)
                            yield frame
                    return
                # This pod's own engine runs the entry stage: an execution, counted as one.
                with counted(pod, "api") as execution:
                    async with contextlib.aclosing(pod.runner.run_stream(si)) as stream:
                        async for frame in stream:
                            if frame.error is not None:
                                execution.failed(frame.error.code)
                            usage.add(frame)
                            yield frame
    finally:
        usage.record(pod.metrics.usage, pod.pipeline.name, si.tenant)


async def collect(
    pipeline: PipelineSpec, frames: AsyncGenerator[HopResult, None]
) -> list[FinalOutput]:
    """Every final output of the request, its chunks joined; the first error → its ApiError."""
    assembler = ChunkAssembler(pipeline)
    async with contextlib.aclosing(frames) as stream:
        async for frame in stream:
            assembler.add(frame)
            if assembler.error is not None:
                break
    error = assembler.end()
    if error is not None:
        raise from_stage_error(error)
    return await joined_off_loop(assembler)
