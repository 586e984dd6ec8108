"""``POST /v1/run``: run only stage k of a request (DESIGN §5).

A headless instance of stage k accepts calls for stage k; an API server accepts calls for any
stage of its pipeline and forwards them to a replica of that stage, so one URL serves a
client's whole loop. The opaque ``stage_input`` is a sealed, HMAC-tagged envelope.

With ``async_chunk`` a stage may stream its output in chunks: the answer then lists every
chunk's next-stage input in chunk order (``next: [...]``, one per chunk per next stage), and
``chunk`` says which chunk of the request the call ran; the client runs each and joins the
final stage's outputs in chunk order.

A join stage (several sources) takes ``stage_inputs``: one opaque input per source, each the
``next`` entry for it in that source's answer, in any order. Each is checked like a
``stage_input`` (tag, receiver), and together they must be one request's, one per source;
the call then runs the join once with all of them (``data_plane/joins.py``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

import msgspec
from aiohttp import web

from omni_mesh.data_plane import codec, wire
from omni_mesh.data_plane.constants import JSON, MSGPACK
from omni_mesh.data_plane.envelope import EnvelopeError, open_envelope, seal
from omni_mesh.data_plane.joins import JoinInputError, join_input
from omni_mesh.data_plane.messages import (
    NextInput,
    NextInputBin,
    Prompt,
    RunRequest,
    RunRequestBin,
    RunResponse,
    RunResponseBin,
    StageInput,
    StageOutput,
    transfer_key,
)
from omni_mesh.data_plane.shm import inline
from omni_mesh.sidecar.admission.admit import admitted
from omni_mesh.sidecar.admission.facts import admission_facts
from omni_mesh.sidecar.admission.outcomes import counted
from omni_mesh.sidecar.api.client_requests import entry
from omni_mesh.sidecar.api.outputs import ENCODED_KINDS, final_output, join_outputs
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.errors import bad_request, decode_body, from_stage_error
from omni_mesh.sidecar.pod import Pod

logger = logging.getLogger(__name__)

RUN_PATH = "/v1/run"


async def run(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    binary = request.content_type == MSGPACK
    body = await wire.read_body(request, max_bytes=pod.settings.max_body_bytes)
    req = _decode(body, binary)
    if req.stage_id not in pod.pipeline.stage_ids:
        raise bad_request(
            f"stage_id: pipeline {pod.pipeline.name!r} has no stage {req.stage_id} "
            f"(stages: {sorted(pod.pipeline.stage_ids)})",
            "stage_id",
        )
    if pod.runner is not None and req.stage_id == pod.stage_id:
        return await _run_local(pod, req, binary, request)
    if pod.settings.headless or (pod.runner is not None and pod.settings.api_only):
        raise bad_request(
            f"stage_id: this instance runs stage {pod.stage_id} only; send stage "
            f"{req.stage_id} to an API server or a replica of that stage",
            "stage_id",
        )
    return await _forward(pod, req.stage_id, body, request)


def _decode(body: bytearray, binary: bool) -> RunRequest | RunRequestBin:
    if binary:
        return decode_body(body, RunRequestBin, what="/v1/run body", binary=True)
    return decode_body(body, RunRequest, what="/v1/run body")


def _stage_input(
    pod: Pod, req: RunRequest | RunRequestBin, request: web.Request, timeout_s: float
) -> StageInput:
    entry_stage = pod.pipeline.entry_stage_id
    raw = req.stage_input
    if pod.pipeline.is_join(req.stage_id):
        si = _join_input(pod, req)
    elif req.stage_inputs is not None:
        raise bad_request(
            f"stage_inputs: stage {req.stage_id} has one source; send its opaque input as "
            "stage_input (stage_inputs is for a join stage)",
            "stage_inputs",
        )
    elif raw is None:
        raise bad_request(f"stage_input: required for stage {req.stage_id}", "stage_input")
    elif req.stage_id == entry_stage:
        if not isinstance(raw, Prompt):
            raise bad_request(
                f"stage_input: stage {entry_stage} is the entry stage and takes a prompt object "
                '({"prompt": "…"}), not an opaque string',
                "stage_input",
            )
        return entry(pod, request, raw, req.sampling_params, param="stage_input")
    else:
        si = _opened(pod, req.stage_id, raw, "stage_input")
    # A fresh deadline for this call: the client drives the loop at its own pace.
    deadline_ms = int((time.time() + timeout_s) * 1000)
    si = msgspec.structs.replace(si, deadline_ms=deadline_ms)
    if req.sampling_params is not None:
        si = msgspec.structs.replace(si, sampling=req.sampling_params)
    return si


def _opened(pod: Pod, stage_id: int, raw: str | bytes | Prompt, what: str) -> StageInput:
    """The sealed input ``raw`` (the field ``what``) for ``stage_id``; 400 naming the field."""
    if isinstance(raw, Prompt):
        raise bad_request(
            f"{what}: stage {stage_id} takes the opaque stage_input returned by the "
            "previous /v1/run call, not a prompt object",
            what.partition("[")[0],
        )
    try:
        return open_envelope(
            raw,
            pod.secret,
            expected_stage=stage_id,
            pipeline=pod.pipeline,
            max_bytes=pod.settings.max_body_bytes,
        )
    except EnvelopeError as exc:
        raise bad_request(f"{what}: {exc}", what.partition("[")[0]) from None


def _join_input(pod: Pod, req: RunRequest | RunRequestBin) -> StageInput:
    """A join call's input: one sealed input per source, one request (400 otherwise)."""
    stage = pod.pipeline.stage(req.stage_id)
    what = f"stage {stage.stage_id} ({stage.name}) is a join of stages {list(stage.sources)}"
    if req.stage_inputs is None:
        raise bad_request(
            f"stage_inputs: {what}: send stage_inputs, one opaque input per source (the next "
            "entries for it in those stages' answers)",
            "stage_inputs",
        )
    if req.stage_input is not None:
        raise bad_request(f"stage_input: {what}: send stage_inputs only", "stage_input")
    inputs: dict[int, StageInput] = {}
    raws: list[str | bytes] = list(req.stage_inputs)
    for i, raw in enumerate(raws):
        si = _opened(pod, req.stage_id, raw, f"stage_inputs[{i}]")
        if si.from_stage in inputs:
            raise bad_request(
                f"stage_inputs[{i}]: a second input from stage {si.from_stage}; {what}, "
                "one input per source",
                "stage_inputs",
            )
        inputs[si.from_stage] = si
    try:
        return join_input(pod.pipeline, req.stage_id, inputs)
    except JoinInputError as exc:
        raise bad_request(f"stage_inputs: {exc}", "stage_inputs") from None


async def _run_local(
    pod: Pod, req: RunRequest | RunRequestBin, binary: bool, request: web.Request
) -> web.Response:
    assert pod.runner is not None
    timeout_s = admission_facts(pod, request).budget_s()  # read once: entry() reads it too
    si = _stage_input(pod, req, request, timeout_s)
    labels = (pod.pipeline.name, str(pod.stage_id))
    t0 = time.monotonic()
    async with admitted(pod, transfer_key(si), "run", si):
        with counted(pod, "run") as execution:
            async with pod.runner.executed(si) as outs:
                error = next((o.error for o in outs if o.error is not None), None)
                if error is not None:
                    execution.failed(error.code)
                    raise from_stage_error(error)
                if _encodes(pod):
                    # WAV/PNG encoding is milliseconds of CPU: off the event loop.
                    body = await asyncio.to_thread(_response, pod, si, outs, binary)
                else:
                    body = _response(pod, si, outs, binary)
    pod.metrics.request_duration.labels(*labels, "run").observe(time.monotonic() - t0)
    content_type = MSGPACK if binary else JSON
    return web.Response(body=body, content_type=content_type)


def _encodes(pod: Pod) -> bool:
    return pod.pipeline.stage(pod.stage_id).final_output in ENCODED_KINDS


def _response(pod: Pod, si: StageInput, outs: list[StageOutput], binary: bool) -> bytes:
    """The answer to one call: every output chunk's next-stage inputs, in chunk order (one
    per chunk per next stage), and the call's final output (its chunks joined: the output
    for the input the call ran)."""
    assert pod.engine is not None
    reader = pod.engine.reader
    sealed = [
        (
            n.stage_id,
            seal(msgspec.structs.replace(n, payload=inline(n.payload, reader)), pod.secret),
        )
        for out in outs
        for n in out.next
    ]
    finals = [
        final_output(pod.pipeline, pod.stage_id, inline(out.final, reader))
        for out in outs
        if out.final is not None
    ]
    final = join_outputs(finals) if finals else None
    if binary:
        rb = RunResponseBin(stage_id=pod.stage_id, request_id=si.request_id, chunk=si.chunk)
        if final is not None:
            rb.output = final.to_run_output_bin()
        if len(sealed) == 1:
            rb.next_stage_id, rb.stage_input = sealed[0]
        elif sealed:
            rb.next = [NextInputBin(stage_id=j, stage_input=b) for j, b in sealed]
        return codec.encode(rb)
    rj = RunResponse(stage_id=pod.stage_id, request_id=si.request_id, chunk=si.chunk)
    if final is not None:
        rj.output = final.to_run_output()
    b64 = [(j, base64.urlsafe_b64encode(b).decode()) for j, b in sealed]
    if len(b64) == 1:
        rj.next_stage_id, rj.stage_input = b64[0]
    elif b64:
        rj.next = [NextInput(stage_id=j, stage_input=s) for j, s in b64]
    return codec.encode_json(rj)


async def _forward(pod: Pod, stage_id: int, body: bytearray, request: web.Request) -> web.Response:
    """API server: pass the call to a replica of the stage, replayed on replica failure."""
    content_type = request.content_type
    deadline_ms = int((time.time() + admission_facts(pod, request).budget_s()) * 1000)
    payload = bytes(body)
    # counted, so a drain waits for it
    async with admitted(pod, f"forward-{id(request)}", "run", deadline_ms=deadline_ms):
        answer = await pod.hop.call(
            stage_id,
            RUN_PATH,
            lambda replica, attempt: payload,
            content_type=content_type,
            deadline_ms=deadline_ms,
        )
    return web.Response(
        body=bytes(answer.body), status=answer.status, content_type=answer.content_type
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post(RUN_PATH, run)
