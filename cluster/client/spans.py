"""Trace context of SDK calls: a CLIENT span per generate call and W3C ``traceparent`` metadata.

All of it is optional (OpenTelemetry may be absent) and never breaks a call: a failure inside
tracing is logged at debug level and the call goes on untraced.
"""

from __future__ import annotations

import logging

try:  # optional: trace context propagation
    from opentelemetry import propagate as _otel_propagate
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - exercised where opentelemetry is absent
    _otel_propagate = _otel_trace = None

logger = logging.getLogger(__name__)


class ClientSpan:
    """The SDK's span of one call (CLIENT kind), when OpenTelemetry's SDK provider is installed;
    its W3C context travels in the call's metadata. A no-op without tracing or without ``rpc``.
    As a context manager it ends with the error that left the block, if any."""

    def __init__(self, rpc: str | None):
        self.span = None
        if _otel_trace is None or rpc is None:
            return
        try:
            span = _otel_trace.get_tracer("dspine.client").start_span(
                f"dspine.v1.DSpine/{rpc}", kind=_otel_trace.SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.method": rpc})
            if span.get_span_context().is_valid:
                self.span = span
        except Exception:  # noqa: BLE001 - tracing never breaks a call
            logger.debug("client span failed", exc_info=True)

    def end(self, error: BaseException | None = None) -> None:
        """End the span (once; later calls do nothing), with ``error``'s status code if given."""
        if self.span is None:
            return
        try:
            if error is not None:
                code = getattr(error, "code", None)
                self.span.set_attribute("rpc.grpc.status_code", getattr(code, "name", str(code)))
                self.span.set_status(_otel_trace.Status(_otel_trace.StatusCode.ERROR, str(error)[:500]))
            else:
                self.span.set_attribute("rpc.grpc.status_code", "OK")
            self.span.end()
        except Exception:  # noqa: BLE001
            logger.debug("client span end failed", exc_info=True)
        self.span = None

    def __enter__(self) -> "ClientSpan":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.end(error)


def trace_metadata(span: ClientSpan | None = None) -> list[tuple[str, str]]:
    """W3C trace context (``traceparent``, ``tracestate``) of the call's span, else of the active
    span; empty without OpenTelemetry or a span."""
    if _otel_propagate is None:
        return []
    try:
        ctx = _otel_trace.set_span_in_context(span.span) if span is not None and span.span is not None else None
        if ctx is None and not _otel_trace.get_current_span().get_span_context().is_valid:
            return []
        carrier: dict[str, str] = {}
        _otel_propagate.inject(carrier, context=ctx)
        return [(key.lower(), value) for key, value in carrier.items()]
    except Exception:  # noqa: BLE001 - tracing never breaks a call
        logger.debug("trace context injection failed", exc_info=True)
        return []
