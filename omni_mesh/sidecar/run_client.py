"""The reference ``/v1/run`` client: run a pipeline one stage call at a time (DESIGN §5).

The client sends the entry stage the prompt object, then follows each answer: ``next_stage_id``
+ ``stage_input`` to the next stage, ``next: [...]`` to several stages at once, until only
outputs remain. It never looks inside the opaque ``stage_input``; it hands it back as it came
(a base64 string in JSON mode, raw bytes in msgpack mode).

Where each call goes is a :class:`StageResolver`: :class:`FixedUrls` (API servers, which accept
every stage and forward), :class:`StageUrls` (one URL per stage) or
:class:`ControlPlaneDiscovery` (a healthy replica of the stage, found through ``omni-cp``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

import aiohttp
import msgspec

from omni_mesh.configs.pipeline import PipelineSpec
from omni_mesh.control_plane.client import ControlPlaneClient, ControlPlaneError
from omni_mesh.data_plane.messages import (
    Prompt,
    RunOutput,
    RunOutputBin,
    RunRequest,
    RunRequestBin,
    RunResponse,
    RunResponseBin,
    SamplingParams,
)

logger = logging.getLogger(__name__)

JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"
#: A run that makes more calls than this many per stage is a server bug (a loop); stop it.
MAX_CALLS_PER_STAGE = 16
MAX_ERROR_CHARS = 2000

StageInputValue = str | bytes | Prompt


class RunClientError(RuntimeError):
    """A run could not complete; the message says which stage and why."""


class StageCallError(RunClientError):
    """A ``/v1/run`` call failed: an HTTP error answer, no answer, or an unusable one."""

    def __init__(self, stage: str, url: str, status: int | None, message: str) -> None:
        self.stage = stage
        self.url = url
        self.status = status
        self.message = message
        what = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{stage} @ {url}: {what}: {message}")


class DiscoveryError(RunClientError):
    """No URL could be found for a stage."""


# ---- where calls go ----------------------------------------------------------------------------


class StageResolver(Protocol):
    async def url_for(self, stage_id: int) -> str:
        """Base URL (``http://host:port``) of an instance that runs ``stage_id``."""
        ...

    async def close(self) -> None:
        """Release what the resolver holds (the client closes its resolver)."""
        ...


class FixedUrls:
    """Every call goes to one of a few API servers, round robin."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("need at least one URL")
        self._next = itertools.cycle([u.rstrip("/") for u in urls])

    async def url_for(self, stage_id: int) -> str:
        return next(self._next)

    async def close(self) -> None:
        return None


class StageUrls:
    """Stage k's calls go to its own URL."""

    def __init__(self, urls: Mapping[int, str]) -> None:
        self._urls = {k: u.rstrip("/") for k, u in urls.items()}

    async def url_for(self, stage_id: int) -> str:
        try:
            return self._urls[stage_id]
        except KeyError:
            raise DiscoveryError(f"no URL given for stage {stage_id}") from None

    async def close(self) -> None:
        return None


class ControlPlaneDiscovery:
    """A random healthy replica of the stage, asked of the control plane for every call
    (``GET /v1/pipelines/{p}/stages/{k}/instances``; several omni-cp URLs fail over)."""

    def __init__(
        self,
        control_plane: str | Sequence[str],
        pipeline: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._client = ControlPlaneClient(control_plane, auth_token=token, timeout_s=timeout_s)
        self._pipeline = pipeline

    async def url_for(self, stage_id: int) -> str:
        try:
            pool = await self._client.instances(self._pipeline, stage_id)
        except ControlPlaneError as exc:
            raise DiscoveryError(f"discovery of stage {stage_id}: {exc}") from exc
        if not pool.instances:
            raise DiscoveryError(
                f"no healthy replica of stage {stage_id} of pipeline {self._pipeline!r} "
                f"is registered at {', '.join(self._client.urls)}"
            )
        return random.choice(pool.instances).address.rstrip("/")

    async def close(self) -> None:
        await self._client.close()


# ---- what a run yields -------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCall:
    """One ``/v1/run`` call of a run, as it happened."""

    index: int  # 1-based, in completion order
    stage_id: int
    stage_name: str
    url: str
    seconds: float
    request_bytes: int
    response_bytes: int
    next_inputs: tuple[tuple[int, int], ...]  # (stage id, size of its opaque input in bytes)
    outputs: Mapping[int, RunOutputBin]

    @property
    def next_input_bytes(self) -> int:
        return sum(size for _, size in self.next_inputs)


@dataclass
class RunTrace:
    """A finished run: its calls and the final outputs by stage id (media as raw bytes)."""

    request_id: str = ""
    calls: list[StageCall] = field(default_factory=list)
    outputs: dict[int, RunOutputBin] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class _Answer:
    stage_id: int
    request_id: str
    outputs: dict[int, RunOutputBin]
    next: list[tuple[int, str | bytes]]


# ---- the client --------------------------------------------------------------------------------


class RunClient:
    """Loops ``/v1/run`` across the stages of ``pipeline``; reusable across runs.

    ``on_call`` is called after each call (progress output). :meth:`close` (or leaving
    ``async with``) closes the resolver and the HTTP session, unless the session was passed in.
    """

    def __init__(
        self,
        pipeline: PipelineSpec,
        resolver: StageResolver,
        *,
        msgpack: bool = False,
        timeout_s: float = 300.0,
        on_call: Callable[[StageCall], None] | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.resolver = resolver
        self.msgpack = msgpack
        self.on_call = on_call
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> RunClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.resolver.close()
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self, prompt: Prompt, sampling: SamplingParams | None = None) -> RunTrace:
        """Run the whole pipeline on ``prompt``; raise :class:`RunClientError` on failure.

        ``sampling`` goes with the entry call; the opaque inputs of later stages carry it."""
        trace = RunTrace()
        start = time.perf_counter()
        await self._hop(trace, self.pipeline.entry_stage_id, prompt, sampling)
        trace.seconds = time.perf_counter() - start
        return trace

    # ---- one call and what follows it --------------------------------------------------------

    async def _hop(
        self,
        trace: RunTrace,
        stage_id: int,
        stage_input: StageInputValue,
        sampling: SamplingParams | None = None,
    ) -> None:
        if len(trace.calls) >= MAX_CALLS_PER_STAGE * len(self.pipeline.stages):
            raise RunClientError(
                f"stopped after {len(trace.calls)} calls: the stages keep returning next inputs"
            )
        url = await self.resolver.url_for(stage_id)
        body = self._encode(stage_id, stage_input, sampling)
        t0 = time.perf_counter()
        raw = await self._post(stage_id, url, body)
        seconds = time.perf_counter() - t0
        answer = self._decode(stage_id, url, raw)
        trace.request_id = trace.request_id or answer.request_id
        trace.outputs.update(answer.outputs)
        call = StageCall(
            index=len(trace.calls) + 1,
            stage_id=stage_id,
            stage_name=self.pipeline.stage(stage_id).name,
            url=url,
            seconds=seconds,
            request_bytes=len(body),
            response_bytes=len(raw),
            next_inputs=tuple((k, len(v)) for k, v in answer.next),
            outputs=answer.outputs,
        )
        trace.calls.append(call)
        logger.debug("run call stage=%d url=%s seconds=%.3f", stage_id, url, seconds)
        if self.on_call is not None:
            self.on_call(call)
        if len(answer.next) == 1:
            await self._hop(trace, *answer.next[0])
        elif answer.next:
            await self._fan_out(trace, answer.next)

    async def _fan_out(self, trace: RunTrace, branches: list[tuple[int, str | bytes]]) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for stage_id, stage_input in branches:
                    group.create_task(self._hop(trace, stage_id, stage_input))
        except BaseExceptionGroup as eg:
            raise _first_leaf(eg) from None

    def _encode(
        self, stage_id: int, stage_input: StageInputValue, sampling: SamplingParams | None
    ) -> bytes:
        if self.msgpack:
            if isinstance(stage_input, str):
                raise TypeError("msgpack mode carries stage inputs as bytes")
            return msgspec.msgpack.encode(RunRequestBin(stage_id, stage_input, sampling))
        if isinstance(stage_input, bytes):
            raise TypeError("JSON mode carries stage inputs as base64 strings")
        return msgspec.json.encode(RunRequest(stage_id, stage_input, sampling))

    async def _post(self, stage_id: int, url: str, body: bytes) -> bytes:
        ctype = MSGPACK_TYPE if self.msgpack else JSON_TYPE
        headers = {"Content-Type": ctype, "Accept": ctype}
        session = self._get_session()
        try:
            async with session.post(
                f"{url}/v1/run", data=body, headers=headers, timeout=self._timeout
            ) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise self._error(stage_id, url, resp.status, error_message(raw))
                return raw
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._error(stage_id, url, None, str(exc) or type(exc).__name__) from exc

    def _decode(self, stage_id: int, url: str, raw: bytes) -> _Answer:
        try:
            answer = _answer(
                msgspec.msgpack.decode(raw, type=RunResponseBin)
                if self.msgpack
                else msgspec.json.decode(raw, type=RunResponse)
            )
            if answer.stage_id != stage_id:
                raise ValueError(f"answer is for stage {answer.stage_id}, not {stage_id}")
            unknown = [k for k, _ in answer.next if k not in self.pipeline.stage_ids]
            if unknown:
                raise ValueError(f"answer names unknown next stage(s) {unknown}")
        except (msgspec.MsgspecError, ValueError) as exc:
            raise self._error(stage_id, url, 200, f"unusable answer: {exc}") from exc
        return answer

    def _error(self, stage_id: int, url: str, status: int | None, message: str) -> StageCallError:
        name = self.pipeline.stage(stage_id).name
        return StageCallError(f"stage {stage_id} ({name})", url, status, message)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session


# ---- answers, both encodings -------------------------------------------------------------------


def _answer(resp: RunResponse | RunResponseBin) -> _Answer:
    outputs = {k: _output_bin(v) for k, v in (resp.outputs or {}).items()}
    if resp.output is not None:
        outputs[resp.stage_id] = _output_bin(resp.output)
    nexts: list[tuple[int, str | bytes]] = [(n.stage_id, n.stage_input) for n in resp.next or ()]
    if not nexts and resp.next_stage_id is not None:
        if resp.stage_input is None:
            raise ValueError("next_stage_id without stage_input")
        nexts.append((resp.next_stage_id, resp.stage_input))
    return _Answer(resp.stage_id, resp.request_id, outputs, nexts)


def _output_bin(out: RunOutput | RunOutputBin) -> RunOutputBin:
    """Outputs as raw bytes: JSON answers carry media as base64."""
    if isinstance(out, RunOutputBin):
        return out
    try:
        data = None if out.data is None else base64.b64decode(out.data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"output data of kind {out.kind!r} is not base64: {exc}") from None
    return RunOutputBin(out.kind, out.text, data, out.mime_type, dict(out.fields))


def _first_leaf(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    first = eg.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def error_message(body: bytes) -> str:
    """The message of an error answer: ``{"error": {"message", "field"?}}``, ``{"error": "…"}``
    (JSON or msgpack), or the body as text."""
    doc: object = None
    for decode in (msgspec.json.decode, msgspec.msgpack.decode):
        try:
            doc = decode(body)
            break
        except msgspec.DecodeError:
            continue
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, str):
            return err[:MAX_ERROR_CHARS]
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message: str = err["message"]
            fld = err.get("field")
            if isinstance(fld, str) and fld not in message:
                message = f"{fld}: {message}"
            return message[:MAX_ERROR_CHARS]
    text = body.decode("utf-8", errors="replace").strip()
    return text[:MAX_ERROR_CHARS] or "(empty body)"


# ---- writing outputs ---------------------------------------------------------------------------

_SUFFIX = {"audio": ".wav", "image": ".png", "data": ".bin"}
_MIME_SUFFIX = {"audio/wav": ".wav", "image/png": ".png", "application/octet-stream": ".bin"}


def output_paths(outputs: Mapping[int, RunOutputBin], output: Path | None) -> dict[int, Path]:
    """Where each media output goes: ``output`` (or ``output.wav``/``.png``/``.bin``) when
    there is one; with several, ``<stem>-<stage id><suffix>``."""
    media = {k: v for k, v in sorted(outputs.items()) if v.data is not None}
    paths: dict[int, Path] = {}
    for stage_id, out in media.items():
        suffix = _MIME_SUFFIX.get(out.mime_type or "", _SUFFIX.get(out.kind, ".bin"))
        path = output if output is not None else Path(f"output{suffix}")
        if len(media) > 1:
            path = path.with_name(f"{path.stem}-{stage_id}{path.suffix or suffix}")
        paths[stage_id] = path
    return paths


def write_outputs(outputs: Mapping[int, RunOutputBin], output: Path | None) -> dict[int, Path]:
    """Write every media output to its :func:`output_paths` path; return the paths."""
    paths = output_paths(outputs, output)
    for stage_id, path in paths.items():
        path.write_bytes(outputs[stage_id].data or b"")
    return paths
