"""What every reference engine shares: the execute loop, input validation and settings.

:class:`ReferenceEngine` validates a whole batch first: a bad request gets an error result (the
message of an :class:`EngineInputError` naming the stage, the request and the field) before any
compute is spent, and the others run as usual. Each request runs on its own under
``torch.inference_mode()`` with a generator seeded from the request's seed alone, so its output
does not depend on what else is in its batch. Weights are seeded from the pipeline and stage
names, so every replica holds the same model.

Streams (``open``): the compute runs lazily, one chunk per ``next()``, each ``next()`` under its
own ``torch.inference_mode()`` (never left entered between the core's steps), so an exception
fails its request alone. A request streams (:meth:`ReferenceEngine.run_chunks`) only when
``ctx.async_chunk`` is on and its input is whole; otherwise its stream is one :meth:`run`.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch

from omni_mesh.data_plane.messages import SamplingParams
from omni_mesh.engines.base import (
    EngineConfigError,
    EngineContext,
    EngineInputError,
    EngineRequest,
    EngineResult,
    StageData,
    StageEngine,
)
from omni_mesh.engines.reference.layers import derive_seed, make_generator

logger = logging.getLogger(__name__)

InputT = TypeVar("InputT")

#: Speaker voices of the talker (OpenAI's classic names plus "default"); the thinker checks a
#: ``voice`` field against them too, so a bad voice fails before any compute is spent.
VOICES = ("default", "alloy", "echo", "fable", "onyx", "nova", "shimmer")

#: Longest prompt (in UTF-8 bytes) a reference model accepts unless ``max_prompt_bytes`` says.
DEFAULT_MAX_PROMPT_BYTES = 4096


@dataclass(frozen=True)
class FieldReader:
    """Typed access to one request's :class:`StageData`; every problem is an
    :class:`EngineInputError` that names the stage (``where``) and the field or array."""

    where: str
    data: StageData

    def error(self, kind: str, name: str, problem: str) -> EngineInputError:
        return EngineInputError(f"{self.where}: {kind} {name!r} {problem}")

    def has(self, name: str) -> bool:
        return self.data.fields.get(name) is not None

    def prompt_bytes(self, name: str, max_bytes: int) -> bytes:
        value = self.data.fields.get(name)
        if value is None:
            raise self.error("field", name, "is required")
        if not isinstance(value, str):
            raise self.error("field", name, f"must be a string, got {type(value).__name__}")
        raw = value.encode("utf-8", errors="replace")
        if not raw:
            raise self.error("field", name, "must not be empty")
        if len(raw) > max_bytes:
            raise self.error("field", name, f"is {len(raw)} bytes long; the limit is {max_bytes}")
        return raw

    def optional_str(self, name: str, default: str) -> str:
        value = self.data.fields.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error("field", name, f"must be a string, got {type(value).__name__}")
        return value

    def optional_int(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        value = self.data.fields.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error("field", name, f"must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise self.error("field", name, f"must be in [{lo}, {hi}], got {value}")
        return value

    def array(
        self, name: str, dtype: type[np.generic], shape: tuple[int | None, ...]
    ) -> np.ndarray:
        """The array ``name`` with exactly ``dtype`` and ``shape`` (``None``: any length >= 1)."""
        arr = self.data.arrays.get(name)
        if arr is None:
            raise self.error("array", name, "is required")
        if not isinstance(arr, np.ndarray):
            raise self.error("array", name, f"must be an array, got {type(arr).__name__}")
        if arr.dtype != np.dtype(dtype):
            raise self.error("array", name, f"must be {np.dtype(dtype)}, got {arr.dtype}")
        want = "(" + ", ".join("N" if d is None else str(d) for d in shape) + ")"
        if arr.ndim != len(shape) or any(
            (d is None and n < 1) or (d is not None and n != d)
            for n, d in zip(arr.shape, shape, strict=True)
        ):
            raise self.error("array", name, f"must have shape {want}, got {arr.shape}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise self.error("array", name, "holds NaN or infinite values")
        return arr

    def int_array(
        self, name: str, shape: tuple[int | None, ...], vocab: int, max_len: int
    ) -> np.ndarray:
        """An int64 array of token ids in ``[0, vocab)`` whose leading dim is at most max_len."""
        arr = self.array(name, np.int64, shape)
        if arr.shape[0] > max_len:
            raise self.error("array", name, f"has {arr.shape[0]} rows; the limit is {max_len}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab):
            raise self.error("array", name, f"must hold ids in [0, {vocab})")
        return arr


def voice_index(fields: FieldReader) -> int:
    """Index in :data:`VOICES` of the ``voice`` field (case-insensitive; default "default")."""
    voice = fields.optional_str("voice", "default")
    if voice.lower() not in VOICES:
        raise fields.error(
            "field", "voice", f"names unknown voice {voice!r}; allowed: {', '.join(VOICES)}"
        )
    return VOICES.index(voice.lower())


def passthrough(data: StageData, names: Sequence[str]) -> dict[str, Any]:
    """The fields of ``data`` among ``names`` that are set (to carry prompt fields downstream)."""
    return {n: data.fields[n] for n in names if data.fields.get(n) is not None}


def as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch view of ``arr``; a copy when it is read-only (backed by a received buffer) or not
    C-contiguous."""
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = np.array(arr, order="C")
    return torch.from_numpy(arr)


#: The reference engines' sampling when a request leaves it unset.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 0  # off


def sampling_or_default(sampling: SamplingParams | None) -> SamplingParams:
    return sampling if sampling is not None else SamplingParams()


def temperature_top_k(
    sampling: SamplingParams | None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int = DEFAULT_TOP_K,
) -> tuple[float, int]:
    """The request's temperature and top_k, each falling back to the given default when unset."""
    if sampling is None:
        return temperature, top_k
    return (
        temperature if sampling.temperature is None else sampling.temperature,
        top_k if sampling.top_k is None else sampling.top_k,
    )


def extra_int(ctx: EngineContext, name: str, default: int, lo: int, hi: int) -> int:
    """An integer engine knob from ``engine_extras`` (a config error if out of bounds)."""
    value = ctx.config.engine_extras.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise EngineConfigError(
            f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.{name} must be an "
            f"integer in [{lo}, {hi}], got {value!r}"
        )
    return value


def extra_float(ctx: EngineContext, name: str, default: float, lo: float, hi: float) -> float:
    value = ctx.config.engine_extras.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise EngineConfigError(
            f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.{name} must be a "
            f"number in [{lo}, {hi}], got {value!r}"
        )
    return float(value)


class ReferenceEngine(StageEngine, Generic[InputT]):
    """Base of the reference engines: ``parse`` validates one request (no compute), ``build``
    makes the model from a weight seed, ``run`` executes one parsed request."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.where = f"stage {ctx.stage.name!r} ({ctx.pipeline.name} stage {ctx.stage.stage_id})"
        self.weight_seed = derive_seed("omni-mesh-weights", ctx.pipeline.name, ctx.stage.name)
        self._loaded = False

    @property
    def is_entry(self) -> bool:
        return not self.ctx.stage.sources

    def load(self) -> None:
        started = time.perf_counter()
        with torch.inference_mode(False), torch.no_grad():
            parameters = self.build(self.weight_seed)
        self._loaded = True
        logger.info(
            "engine loaded pipeline=%s stage=%s engine=%s parameters=%d load_s=%.2f",
            self.ctx.pipeline.name,
            self.ctx.stage.name,
            type(self).__name__,
            parameters,
            time.perf_counter() - started,
        )

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        """Every request's whole result (no streaming), in the batch's order."""
        results = []
        for stream in self._streams(batch, streaming=False):
            result = next(stream)
            if result is None:  # a whole run (no run_chunks) yields its one result
                raise RuntimeError(f"{self.where}: a whole run gave no result")
            results.append(result)
        return results

    def open(self, batch: Sequence[EngineRequest]) -> list[Iterator[EngineResult | None]]:
        return self._streams(batch, streaming=self.ctx.async_chunk)

    def _streams(
        self, batch: Sequence[EngineRequest], *, streaming: bool
    ) -> list[Iterator[EngineResult | None]]:
        if not self._loaded:
            raise RuntimeError(f"{self.where}: execute() called before load()")
        streams: list[Iterator[EngineResult | None]] = []
        for request in batch:  # validate everything first; a bad one fails alone, no compute
            try:
                inputs = self.parse(request)
            except EngineInputError as exc:
                logger.info(
                    "bad input stage=%s request_id=%s: %s",
                    self.ctx.stage.name,
                    request.request_id,
                    exc,
                )
                streams.append(iter([EngineResult(request.request_id, error=str(exc))]))
                continue
            streams.append(self._stream(request, inputs, streaming=streaming))
        return streams

    def _stream(
        self, request: EngineRequest, inputs: InputT, *, streaming: bool
    ) -> Iterator[EngineResult | None]:
        """The stream of one valid request (lazy: nothing runs before its first ``next()``)."""
        generator = make_generator(derive_seed("omni-mesh-request", self.where, request.seed))
        if streaming and request.whole:
            chunks = self.run_chunks(request, inputs, generator)
        else:
            chunks = self._run_whole(request, inputs, generator)
        return _in_inference_mode(chunks)

    def _run_whole(
        self, request: EngineRequest, inputs: InputT, generator: torch.Generator
    ) -> Iterator[EngineResult]:
        started = time.perf_counter()
        result = self.run(request, inputs, generator)
        logger.debug(
            "executed stage=%s request_id=%s ms=%.1f output_bytes=%d",
            self.ctx.stage.name,
            request.request_id,
            (time.perf_counter() - started) * 1e3,
            result.output.nbytes(),
        )
        yield result

    def run_chunks(
        self, request: EngineRequest, inputs: InputT, generator: torch.Generator
    ) -> Iterator[EngineResult | None]:
        """Execute one request as a stream of chunks (``last=True`` on the final one), one
        per ``next()``, each under ``torch.inference_mode()``; a None is a step with no chunk
        (the engine's other streams, and aborts, get their turn). The default: one
        :meth:`run`."""
        yield self.run(request, inputs, generator)

    def close(self) -> None:
        """Drop the model; ``execute`` fails until ``load`` runs again."""
        self._loaded = False
        vars(self).pop("model", None)

    def reader(self, request: EngineRequest) -> FieldReader:
        return FieldReader(f"{self.where} request {request.request_id!r}", request.data)

    @abstractmethod
    def build(self, seed: int) -> int:
        """Create the model with weights from ``seed``; return its parameter count."""

    @abstractmethod
    def parse(self, request: EngineRequest) -> InputT:
        """Validate one request's input (raise :class:`EngineInputError`); no model compute."""

    @abstractmethod
    def run(
        self, request: EngineRequest, inputs: InputT, generator: torch.Generator
    ) -> EngineResult:
        """Execute one request (inside ``torch.inference_mode()``)."""


_END = object()


def _in_inference_mode(
    chunks: Iterator[EngineResult | None],
) -> Iterator[EngineResult | None]:
    """``chunks`` advanced one ``next()`` at a time inside ``torch.inference_mode()``; the mode
    is left between items, so nothing else in the process runs in it. A None (no result this
    step) is passed on."""
    try:
        while True:
            with torch.inference_mode():
                item = next(chunks, _END)
            if item is _END:
                return
            yield cast("EngineResult | None", item)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
