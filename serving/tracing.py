"""OpenTelemetry traces for the router and the engine, exported over OTLP/HTTP.

Off until ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set:
until then ``TRACER`` is None, the SDK is never imported and every hook is one test of that global.
On, the SDK reads the standard variables itself (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_SCHEDULE_DELAY`` ...);
spans leave in batches from the SDK's own thread. A client's W3C ``traceparent`` is the parent
of the server's first span, and each request to an engine carries the router's attempt span as
its ``traceparent``.

Span names (docs/operations.md, "Traces"): the router's ``dpmesh.router.request`` with its
``admission``, ``route`` and ``attempt`` children; the engine's ``dpmesh.engine.request`` with
``queue``, ``prefill`` (an event per chunk) and ``decode``.
"""

from __future__ import annotations

import atexit
import logging
import os

logger = logging.getLogger(__name__)

TRACER = None  # an opentelemetry Tracer once ``setup`` found an endpoint
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def setup(service_name: str) -> bool:
    """Start exporting this process's spans when an OTLP endpoint is configured (idempotent)."""
    global TRACER
    if TRACER is not None:
        return True
    if not any(os.environ.get(name) for name in _ENDPOINT_VARS):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    atexit.register(provider.shutdown)  # what is still batched leaves on the way out
    TRACER = provider.get_tracer("dpmesh")
    logger.info("exporting traces over OTLP as %s", resource.attributes.get("service.name"))
    return True


def parent_from(headers) -> object | None:
    """The context a client's ``traceparent`` (and ``tracestate``) names, from ASGI header pairs
    or a dict of lower-case names; None without one."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if isinstance(headers, dict):
        carrier = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
    else:
        carrier = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in headers or ()
            if name.lower() in (b"traceparent", b"tracestate")
        }
    if "traceparent" not in carrier:
        return None
    return TraceContextTextMapPropagator().extract(carrier)


def inject(headers: dict) -> None:
    """Add the current span's ``traceparent`` to outgoing ``headers``."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    TraceContextTextMapPropagator().inject(headers)


def current_span():
    from opentelemetry import trace

    return trace.get_current_span()


class _Null:
    """The context manager of a span not taken: yields None."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def span(name: str, **attributes):
    """A child of the current span while tracing is on, else a no-op (``with ... as s``: None)."""
    if TRACER is None:
        return _NULL
    return TRACER.start_as_current_span(name, attributes=attributes or None)


def server_span(name: str, parent, **attributes):  # called only while tracing is on
    """The first span of a request this process serves, the child of the client's own."""
    from opentelemetry.trace import SpanKind

    return TRACER.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes or None
    )


def client_span(name: str, **attributes):
    """A span of a request this process sends on (its ``traceparent`` goes with it); a no-op
    while tracing is off, as ``span``."""
    if TRACER is None:
        return _NULL
    from opentelemetry.trace import SpanKind

    return TRACER.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes or None)


def engine_request_spans(parent, arrived_ns: int, first_ns: int | None, finished_ns: int,
                         chunks, attributes: dict) -> None:  # fmt: skip
    """One engine request's spans, made after it finished from the times the front and its rank
    saw: ``dpmesh.engine.request`` (the child of ``parent``) with ``queue`` (arrival to its first
    prefill chunk), ``prefill`` (to its first token; an event per chunk) and ``decode`` (to the
    end). ``chunks``: the rank's (start s, end s, tokens) per prefill chunk (wall clock)."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    tracer = TRACER
    root = tracer.start_span("dpmesh.engine.request", context=parent, kind=SpanKind.SERVER,
                             start_time=arrived_ns, attributes=attributes)  # fmt: skip
    inside = trace.set_span_in_context(root)
    first = first_ns or finished_ns
    scheduled = max(arrived_ns, int(chunks[0][0] * 1e9)) if chunks else first
    tracer.start_span("dpmesh.engine.queue", context=inside, start_time=arrived_ns).end(
        end_time=scheduled
    )
    prefill = tracer.start_span("dpmesh.engine.prefill", context=inside, start_time=scheduled)
    for start, end, tokens in chunks or ():
        prefill.add_event("chunk", {"tokens": tokens, "duration_ms": (end - start) * 1000},
                          timestamp=int(start * 1e9))  # fmt: skip
    prefill.end(end_time=max(scheduled, first))
    tracer.start_span("dpmesh.engine.decode", context=inside, start_time=first).end(
        end_time=finished_ns
    )
    root.end(end_time=finished_ns)
