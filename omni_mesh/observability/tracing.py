"""OpenTelemetry tracing: one span per stage execution, joined into one trace per request.

The W3C ``traceparent`` travels inside every :class:`StageInput` (not in HTTP headers only), so
a request's trace survives hops, replays and external ``/v1/run`` loops alike. Exporters:
``none`` (default: spans are not recorded), ``console`` (JSON lines on stderr) and ``otlp``
(needs the ``opentelemetry-exporter-otlp`` package; configured by the standard ``OTEL_*``
environment variables).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from enum import StrEnum

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_enabled = False  # set by setup_tracing; off, stage_span costs nothing on the hot path
_TRACER_NAME = "omni_mesh"


class TracingExporter(StrEnum):
    NONE = "none"
    CONSOLE = "console"
    OTLP = "otlp"


def setup_tracing(service_name: str, exporter: TracingExporter) -> TracerProvider | None:
    """Install a tracer provider for this process; ``none`` installs nothing."""
    if exporter is TracingExporter.NONE:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is TracingExporter.CONSOLE:
        console = ConsoleSpanExporter(
            out=sys.stderr, formatter=lambda s: s.to_json(indent=None) + "\n"
        )
        provider.add_span_processor(SimpleSpanProcessor(console))
    else:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    trace.set_tracer_provider(provider)
    global _enabled
    _enabled = True
    logger.info("tracing on: service=%s exporter=%s", service_name, exporter.value)
    return provider


def tracing_on() -> bool:
    """Whether :func:`setup_tracing` installed a provider in this process (hot paths skip
    building span attributes when not)."""
    return _enabled


def _otlp_exporter() -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
            OTLPSpanExporter,
        )
    except ImportError:
        raise ValueError(
            "--tracing otlp needs the opentelemetry-exporter-otlp package "
            "(pip install opentelemetry-exporter-otlp)"
        ) from None
    exporter: SpanExporter = OTLPSpanExporter()
    return exporter


#: Attributes known only when a span ends (a streamed answer's audio figures).
LateAttributes = Callable[[], Mapping[str, str | int | float]]


@contextlib.contextmanager
def stage_span(
    name: str,
    traceparent: str,
    attributes: Mapping[str, str | int],
    late: LateAttributes | None = None,
) -> Iterator[str]:
    """A span for one stage execution, child of ``traceparent`` (when valid); yields the
    ``traceparent`` that the next stages' inputs should carry (the parent's when tracing is
    off, so a trace started upstream stays whole). An exception marks it failed; ``late``
    gives attributes set as it ends."""
    span = open_stage_span(name, traceparent, attributes)
    if span is None:
        yield traceparent
        return
    try:
        yield span.traceparent
    except BaseException as exc:
        if late is not None:
            span.set_attributes(late())
        span.end(exc)
        raise
    if late is not None:
        span.set_attributes(late())
    span.end()


class StageSpan:
    """One stage execution's span, ended by hand: :meth:`end` when the execution ended, or —
    when it was cancelled — once the engine has acknowledged the abort (:meth:`cancelled`
    then :meth:`acknowledged`), so the cancel's way through every stage shows in the trace."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: trace.Span, traceparent: str) -> None:
        self._span = span
        self.traceparent = traceparent

    def set_attributes(self, attributes: Mapping[str, str | int | float]) -> None:
        self._span.set_attributes(dict(attributes))

    def end(self, exc: BaseException | None = None) -> None:
        """End the span; an exception marks it failed (a cancellation does not)."""
        if isinstance(exc, Exception):
            self._span.record_exception(exc)
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}"))
        self._span.end()

    def cancelled(self, attributes: Mapping[str, str | int]) -> None:
        """The stage left the work before its end (the caller went away): ``omni.cancel``."""
        self._span.set_attribute("omni.outcome", "cancelled")
        self._span.add_event("omni.cancel", dict(attributes))

    def acknowledged(self, attributes: Mapping[str, str | int | float]) -> None:
        """The engine stopped the work (``omni.cancel.acknowledged``); ends the span."""
        self._span.add_event("omni.cancel.acknowledged", dict(attributes))
        self._span.end()


def open_stage_span(
    name: str, traceparent: str, attributes: Mapping[str, str | int]
) -> StageSpan | None:
    """A started :class:`StageSpan`, child of ``traceparent`` (when valid); None when tracing
    is off or the span is not recorded (then the parent's traceparent travels on)."""
    if not _enabled:
        return None
    carrier = {"traceparent": traceparent} if traceparent else {}
    parent = _PROPAGATOR.extract(carrier)
    span = trace.get_tracer(_TRACER_NAME).start_span(
        name, context=parent, attributes=dict(attributes)
    )
    if not span.get_span_context().is_valid:
        span.end()
        return None
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
    return StageSpan(span, out.get("traceparent", traceparent))
