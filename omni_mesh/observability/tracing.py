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
from collections.abc import Iterator, Mapping
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


@contextlib.contextmanager
def stage_span(name: str, traceparent: str, attributes: Mapping[str, str | int]) -> Iterator[str]:
    """A span for one stage execution, child of ``traceparent`` (when valid); yields the
    ``traceparent`` that the next stages' inputs should carry (the parent's when tracing is
    off, so a trace started upstream stays whole)."""
    if not _enabled:
        yield traceparent
        return
    carrier = {"traceparent": traceparent} if traceparent else {}
    parent = _PROPAGATOR.extract(carrier)
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(name, context=parent, attributes=dict(attributes)) as span:
        if not span.get_span_context().is_valid:
            yield traceparent
            return
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out)
        yield out.get("traceparent", traceparent)
