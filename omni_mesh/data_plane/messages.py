"""Every message that crosses a process boundary on the data path.

Three boundaries use these types:

* sidecar ⇄ engine (same pod, a Unix socket for headers, shared memory for tensors):
  :class:`EngineMessage` variants;
* sidecar ⇄ sidecar (a hop between stages, HTTP with msgpack bodies): :class:`StageInput`
  going out, :class:`HopResult` coming back;
* client ⇄ sidecar (``POST /v1/run``): :class:`RunRequest` / :class:`RunResponse`, where the
  opaque ``stage_input`` string is a sealed :class:`StageInput` (see ``envelope.py``).

Tensors never travel as Python lists: a :class:`Tensor` carries either its raw bytes (a
zero-copy ``memoryview`` once decoded) or a :class:`ShmRef` naming a pooled shared-memory slot
on this host. Everything is a ``msgspec.Struct``; no pickle, no dicts-of-anything.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

#: Version of every persisted or client-visible structure (StageInput envelopes).
SCHEMA_VERSION = 1

MAX_PROMPT_CHARS = 32_768
MAX_IMAGE_SIDE = 4096  # the longest image side a prompt may ask for (engines set their own)
MAX_REQUEST_ID = 128

Scalar = str | int | float | bool | None
StageId = Annotated[int, Meta(ge=0, lt=64)]
#: Admission classes, served strictly in this order (high first) at every stage's queue.
PriorityClass = Literal["high", "normal", "low"]
#: Who a request is counted against for fair share: ``X-Omni-Tenant`` or a hash of its API key.
Tenant = Annotated[str, Meta(max_length=64)]
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID, pattern=r"^[\w\-.:]+$")]


# ---- tensors ---------------------------------------------------------------------------------


class ShmRef(Struct, frozen=True):
    """A slot of a pooled shared-memory segment on this host."""

    segment: str  # name under /dev/shm, e.g. "omni-1234-ab12cd-7"
    offset: int
    nbytes: int


class Tensor(Struct):
    """An n-dimensional array: raw little-endian bytes inline, or a shared-memory slot."""

    dtype: str  # numpy dtype string: "float32", "int64", "uint8", …
    shape: tuple[int, ...]
    data: memoryview | None = None
    shm: ShmRef | None = None


class Payload(Struct):
    """What one stage hands another (or contributes to the final answer): named scalars and
    named tensors. The names are the pipeline's business; the fabric never looks inside."""

    fields: dict[str, Scalar] = {}
    tensors: dict[str, Tensor] = {}


# ---- client-facing inputs --------------------------------------------------------------------


class SamplingParams(Struct, forbid_unknown_fields=True):
    """Optional sampling knobs for AR stages. Every field is optional: ``None`` = unset, so the
    stage's own default applies (a vLLM stage's ``sampling:``; a reference engine's built-in
    temperature 0.8 / top_k 0 = off) and a request overrides only what it sets."""

    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=1_000_000)] | None = None  # 0 = off
    max_tokens: Annotated[int, Meta(ge=1, le=8192)] | None = None
    # vLLM stages (reference engines ignore these).
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    stop: (
        Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=16)]
        | None
    ) = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # top-n per token; 0 = sampled only
    ignore_eos: bool | None = None  # generate max_tokens whatever the model says (benchmarks)


class Prompt(Struct, forbid_unknown_fields=True):
    """The entry stage's input as a client writes it (``/v1/run`` stage 0, ``/v1/generate``).

    Which optional fields a pipeline accepts is listed in its ``prompt_fields``."""

    prompt: Annotated[str, Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    voice: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=8192)] | None = None
    size: Annotated[int, Meta(ge=16, le=512)] | None = None
    steps: Annotated[int, Meta(ge=1, le=200)] | None = None
    # An image's sides in pixels, both or neither (a pipeline of non-square images; its
    # engines check them against the model's own multiple and bounds).
    width: Annotated[int, Meta(ge=16, le=MAX_IMAGE_SIDE)] | None = None
    height: Annotated[int, Meta(ge=16, le=MAX_IMAGE_SIDE)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0.0, le=30.0)] | None = None
    # Previews of the image streamed before it (OpenAI's ``partial_images``, 0-3).
    partial_images: Annotated[int, Meta(ge=0, le=3)] | None = None
    request_id: RequestId | None = None
    priority: PriorityClass | None = None  # the body's class; an X-Omni-Priority header wins


# ---- the hop ---------------------------------------------------------------------------------


class StageInput(Struct, kw_only=True):
    """Everything stage ``stage_id`` needs to run one request: self-contained (invariant 1).

    A transfer is named by (request_id, from_stage, stage_id, chunk, attempt) — never by
    the id of the HTTP call that carried it (invariant 2)."""

    version: int = SCHEMA_VERSION
    pipeline: str
    request_id: RequestId
    stage_id: StageId  # the receiver
    from_stage: int = -1  # -1: built from the client's prompt
    chunk: int = 0  # index of this input in the sender's stream of chunks (async_chunk)
    last: bool = True  # False: more chunks of the same transfer follow
    attempt: int = 0
    deadline_ms: int  # absolute, Unix epoch milliseconds
    seed: int
    traceparent: str = ""  # W3C trace context of the request
    sampling: SamplingParams | None = None
    payload: Payload = msgspec.field(default_factory=Payload)
    priority: PriorityClass = "normal"  # every stage's admission queue orders by it
    tenant: Tenant = ""  # fair share between tenants of one class; "" = anonymous
    # The final outputs the client wants (stage ids; () = every one): a stage hands inputs on
    # only to the stages that lead to one of them (a text-only chat skips the audio stages).
    final_stages: tuple[int, ...] = ()
    # A split stage's KV hand-off (``data_plane/kv_transfer.py``): "" runs as ever; a prefill
    # request; or the params of a prefill answer, for the decode replica to pull the KV with.
    kv_transfer: str = ""
    # A streamed input (a stage whose spec has ``stream_input``, under ``async_chunk``): set on
    # its chunk 0 only, the address of the sender's sidecar, which holds the later chunks
    # for the receiver to pull (``sidecar/hop/input_stream.py``); "" otherwise.
    stream_from: str = ""
    # Session affinity (``sidecar/hop/affinity.py``): a key (a realtime session, a chat's
    # session or user, its conversation's start) whose hops go to the same replica of each
    # stage while it has room, so that one conversation finds its prefix cache; "" = none.
    affinity: str = ""


def is_whole(si: StageInput) -> bool:
    """Whether ``si`` is a whole output of its sender (not a chunk of a stream). A stage may
    stream chunks for a whole input; a chunk gets exactly one output (with its index)."""
    return si.chunk == 0 and si.last


def opens_input_stream(si: StageInput) -> bool:
    """Whether ``si`` is the first chunk of a streamed input: the receiver runs one request
    whose input grows as the later chunks arrive (pulled from ``si.stream_from``)."""
    return si.chunk == 0 and not si.last and bool(si.stream_from)


def streams_out(si: StageInput) -> bool:
    """Whether the answer to ``si`` may be a stream of chunks: a whole input, or the first
    chunk of a streamed input. Any other chunk gets exactly one output."""
    return is_whole(si) or opens_input_stream(si)


def transfer_key(si: StageInput) -> str:
    """What names one piece of work on a stage: the request for a whole input (or a streamed
    one), the request and the chunk for a chunk of an upstream stream (several chunks of one
    request may run on one replica at once). The sidecar⇄engine messages and the engine's
    shared-memory slots are keyed by it."""
    return si.request_id if streams_out(si) else f"{si.request_id}/{si.chunk}"


class StageTiming(Struct):
    """How long one stage took for one request (reported back along the chain)."""

    stage_id: int
    instance_id: str
    engine_ms: float
    queue_ms: float
    total_ms: float
    output_bytes: int = 0
    # Engine time attributed to the request (each engine step's time shared among the
    # requests it advanced): what it used of the stage, for usage and billing.
    used_ms: float = 0.0


class StageError(Struct):
    """A request-level failure, travelling as data (the process itself is fine)."""

    code: Literal["bad_input", "engine_error", "aborted", "deadline", "unavailable", "shed"]
    message: str
    stage_id: int = -1


class StageOutput(Struct, kw_only=True):
    """What one stage execution yields for one request: its contribution to the final
    answer (if it is a final stage) and the inputs of the next stage(s)."""

    request_id: str
    stage_id: int
    chunk: int = 0  # which chunk of the request's output this is (0 for a whole output)
    last: bool = True  # False: the engine emits more chunks for this request
    final: Payload | None = None
    next: list[StageInput] = []
    error: StageError | None = None
    engine_ms: float = 0.0
    queue_ms: float = 0.0
    kv_transfer: str = ""  # a prefill request's answer: where its KV blocks wait
    # The request's share of the engine steps since its previous output (each step's time
    # divided among the requests it advanced); summed over its outputs: the stage's use.
    used_ms: float = 0.0


class HopResult(Struct, kw_only=True):
    """The answer to a hop: the merged final outputs of every stage at or after the receiver,
    so the client's connection travels along one chain (DESIGN §4).

    With ``async_chunk`` an answer may be a stream of these *frames*: every frame but the
    last has ``more=True``; a frame's outputs are the chunks ``chunks[stage]`` (0 when absent)
    of each stage's final output, and a receiver assembles them by (stage, chunk). Timings
    accumulate over the frames; an error ends the stream."""

    request_id: str
    outputs: dict[int, Payload] = {}
    chunks: dict[int, int] = {}
    timings: list[StageTiming] = []
    error: StageError | None = None
    more: bool = False
    #: Inputs of join stages (several sources) produced at or after the receiver, tensors
    #: inline: a source of a join does not hop to it but hands its input back up, frame by
    #: frame, to the runner of the join's collector stage, which hands the join off once.
    joins: list[StageInput] = []
    #: The answer of a prefill replica (``data_plane/kv_transfer.py``): vLLM's params of the
    #: prompt's KV blocks, for the decode replica; the only thing such an answer carries.
    kv_transfer: str = ""


# ---- sidecar ⇄ engine ------------------------------------------------------------------------


class Hello(Struct, tag="hello"):
    """Engine → sidecar, first message: the engine process is up and loading."""

    pid: int
    shm_prefix: str  # prefix of the segments this engine owns


class Ready(Struct, tag="ready"):
    """Engine → sidecar: the model is loaded; work may be submitted."""

    engine: str
    max_num_seqs: int
    load_seconds: float


class Submit(Struct, tag="submit"):
    """Sidecar → engine: run one request (or one chunk of it: the work is named by
    :func:`transfer_key`). Tensors reference the sidecar's shm slots."""

    stage_input: StageInput


class Feed(Struct, tag="feed"):
    """Sidecar → engine: a later chunk of a streamed input (:func:`opens_input_stream`), for
    the running work ``key``; its tensors travel inline (no reply: the engine merges it into
    the request's input, or drops it when the work is gone)."""

    key: str  # transfer_key of the work the input stream opened
    stage_input: StageInput


class Abort(Struct, tag="abort"):
    """Sidecar → engine: drop a piece of work (client gone, deadline passed)."""

    key: str  # transfer_key of the submitted input


class Release(Struct, tag="release"):
    """Sidecar → engine: the engine's output slots for this work are no longer needed."""

    key: str  # transfer_key of the submitted input


class Result(Struct, tag="result"):
    """Engine → sidecar: one output of a piece of work (its only one, or one of its chunks).
    Output tensors reference engine slots, owned by the engine until :class:`Release`."""

    output: StageOutput
    key: str  # transfer_key of the input it answers


class Results(Struct, tag="results"):
    """Engine → sidecar: every output of one engine step, in one frame (as vLLM's
    ``EngineCoreOutputs`` carries a step's rows): one encode, one write and one wake-up for a
    step of many streams, not one per output."""

    results: list[Result]


class EngineStats(Struct):
    """What a model engine with its own scheduler (vLLM) reports inside :class:`Stats`."""

    running: int  # requests in the engine's running batch
    waiting: int  # requests queued inside the engine
    kv_cache_usage: float  # fraction of the KV cache in use, 0..1
    tokens_per_s: float  # generated tokens per second since the previous report
    # A split stage's KV transfers (``engines/vllm/kv_split.py``), totals since the engine
    # started: pulls and their bytes, pulls that failed (prefilled locally instead), and
    # prefilled KV freed unpulled when its lease ran out.
    kv_pulled: int = 0
    kv_pulled_bytes: int = 0
    kv_pulled_s: float = 0.0  # the pulls' transfer time
    kv_pull_failed: int = 0
    kv_expired: int = 0
    # A split stage's prompt tokens not prefilled yet: the unfinished requests' prompts less
    # what the engine computed of them (a prefill replica's queue, for the senders' routers).
    prefill_tokens_queued: int = 0


class Stats(Struct, tag="stats"):
    """Engine → sidecar, periodically: load and step statistics."""

    queued: int
    running: int
    batch_size: int
    step_ms: float
    steps: int
    engine: EngineStats | None = None  # the model engine's own view (vLLM); None otherwise
    step_audio_s: float = 0.0  # audio seconds a step makes per stream (StageEngine's); 0: none
    busy_ms: float = 0.0  # the engine's stepping time since it started (usage's reference)


class Shutdown(Struct, tag="shutdown"):
    """Sidecar → engine: finish in-flight work and exit."""

    drain: bool = True


class Fatal(Struct, tag="fatal"):
    """Engine → sidecar: the engine cannot go on (load failure, unrecoverable error)."""

    message: str
    config_error: bool = False  # its settings are unusable (not a transient failure)


EngineMessage = (
    Hello | Ready | Submit | Feed | Abort | Release | Result | Results | Stats | Shutdown | Fatal
)


# ---- /v1/run (client ⇄ sidecar) --------------------------------------------------------------
# JSON bodies carry the opaque stage input as a base64 string; ``application/msgpack`` bodies
# carry it as raw bytes. msgspec cannot decode ``str | bytes`` unions, hence the *Bin twins.


MAX_JOIN_INPUTS = 16
JoinInputs = Annotated[list[str], Meta(min_length=1, max_length=MAX_JOIN_INPUTS)]
JoinInputsBin = Annotated[list[bytes], Meta(min_length=1, max_length=MAX_JOIN_INPUTS)]


class RunRequest(Struct, forbid_unknown_fields=True):
    """``POST /v1/run`` JSON body: a prompt object for the entry stage, the opaque string
    returned by the previous call otherwise; a join stage (several sources) takes
    ``stage_inputs`` instead, one opaque string per source. Exactly one of the two is set."""

    stage_id: StageId
    stage_input: str | Prompt | None = None
    sampling_params: SamplingParams | None = None
    stage_inputs: JoinInputs | None = None


class RunRequestBin(Struct, forbid_unknown_fields=True):
    """``POST /v1/run`` msgpack body (``stage_input`` as raw envelope bytes)."""

    stage_id: StageId
    stage_input: bytes | Prompt | None = None
    sampling_params: SamplingParams | None = None
    stage_inputs: JoinInputsBin | None = None


class RunOutput(Struct, omit_defaults=True):
    """A final output as a client sees it: text, or media (base64 in JSON, bytes in msgpack)."""

    kind: str  # "text" | "audio" | "image" | "data"
    text: str | None = None
    data: str | None = None
    mime_type: str | None = None
    fields: dict[str, Scalar] = {}


class RunOutputBin(Struct, omit_defaults=True):
    kind: str
    text: str | None = None
    data: bytes | None = None
    mime_type: str | None = None
    fields: dict[str, Scalar] = {}


class NextInput(Struct):
    stage_id: int
    stage_input: str


class NextInputBin(Struct):
    stage_id: int
    stage_input: bytes


class RunResponse(Struct, omit_defaults=True):
    """``POST /v1/run`` JSON answer: the next stage's opaque input while stages remain
    (``next`` when several stages follow), ``outputs`` from stages whose output is final."""

    stage_id: int
    request_id: str
    chunk: int = 0  # the chunk of the request this call ran (async_chunk streams)
    next_stage_id: int | None = None
    stage_input: str | None = None
    next: list[NextInput] | None = None
    output: RunOutput | None = None
    outputs: dict[int, RunOutput] | None = None


class RunResponseBin(Struct, omit_defaults=True):
    stage_id: int
    request_id: str
    chunk: int = 0  # the chunk of the request this call ran (async_chunk streams)
    next_stage_id: int | None = None
    stage_input: bytes | None = None
    next: list[NextInputBin] | None = None
    output: RunOutputBin | None = None
    outputs: dict[int, RunOutputBin] | None = None
