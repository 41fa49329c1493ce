"""The one tracing module: OpenTelemetry setup, request spans, and the engine's stages as spans.

Setup (:func:`configure`) reads the standard environment: a process exports
spans when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set
or ``OTEL_TRACES_EXPORTER`` names an exporter; ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_TRACES_SAMPLER(_ARG)`` apply as the SDK
defines them. Inside Ray Serve, Serve's own tracing (enabled through
``RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH=dspine.cluster.tracing:span_processors``
and ``RAY_SERVE_TRACING_SAMPLING_RATIO``, on every node) installs the provider;
ours then only adds spans to it, so client -> proxy -> ingress -> replica ->
engine stages form one trace.

Spans of one request (:func:`record_engine_spans`, built after the request
finished from the engine's own step records, so the hot path pays nothing):

    dspine.engine                        arrival -> finish, on the replica
      dspine.queue                       arrival -> its first step
      dspine.prefill                     its prefill stage
      dspine.decode                      first token -> finish
        dspine.cycle / dspine.target_step   one per step (at most ``max_step_spans``:
          dspine.draft / .tail /            the first and the last halves; the
          .verify / .commit                 attribute dspine.steps_omitted counts the rest)

with GenAI semantic-convention attributes where they fit
(``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ...) and ``dspine.*``
for speculation. Tracing failures are logged, never raised into requests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from dspine.replica.step_stats import STAGES

logger = logging.getLogger(__name__)

TRACER_NAME = "dspine"
# perf_counter seconds (the engine's clock) -> epoch nanoseconds (OpenTelemetry's).
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()
_SPEC_STAGES = ("draft", "tail", "verify", "commit")


def to_epoch_ns(perf_seconds: float) -> int:
    return int(perf_seconds * 1e9) + _EPOCH_OFFSET_NS


def exporting_env() -> bool:
    env = os.environ
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_TRACES_EXPORTER", "none") not in ("none", ""))


def span_processors() -> list:
    """Span processors from the environment: Serve's ``RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH``
    factory (a batch processor over the OTLP/gRPC exporter, configured by ``OTEL_EXPORTER_OTLP_*``)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return [BatchSpanProcessor(OTLPSpanExporter())]


def configure(service_name: str, replica_id: str | None = None, processors: Sequence | None = None) -> bool:
    """Install a tracer provider for this process unless one exists; True when spans are exported.

    ``processors`` (e.g. a ``SimpleSpanProcessor(InMemorySpanExporter())`` in tests) replace the
    environment's OTLP export."""
    try:
        current = trace.get_tracer_provider()
        if _is_sdk_provider(current):
            return True  # Ray Serve's (or an earlier configure()): add spans to it
        if processors is None and not exporting_env():
            return False
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}
        if replica_id:
            attributes["dspine.replica_id"] = replica_id
        provider = TracerProvider(resource=Resource.create(attributes))
        for processor in processors if processors is not None else span_processors():
            provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
        return _is_sdk_provider(trace.get_tracer_provider())
    except Exception:  # noqa: BLE001 - tracing must never stop a server from starting
        logger.exception("tracing setup failed; continuing without traces")
        return False


def _is_sdk_provider(provider) -> bool:
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(provider, TracerProvider)


def tracer():
    return trace.get_tracer(TRACER_NAME)


def enabled() -> bool:
    return _is_sdk_provider(trace.get_tracer_provider())


def context_from_metadata(metadata: Iterable[tuple[str, str]] | None):
    """The W3C trace context carried in gRPC metadata (``traceparent``/``tracestate``)."""
    carrier = {key.lower(): value for key, value in (metadata or ()) if isinstance(value, str)}
    return propagate.extract(carrier)


def parent_context(metadata: Iterable[tuple[str, str]] | None):
    """The parent of a new span: the current context when a span is active (Serve's own, with Ray
    tracing on), else the W3C context carried in ``metadata`` (a client's, or the ingress's)."""
    if trace.get_current_span().get_span_context().is_valid:
        return otel_context.get_current()
    return context_from_metadata(metadata)


def carrier_of(ctx=None) -> dict[str, str]:
    """``ctx`` (default: the current context) as a W3C carrier, to cross a process boundary."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def request_attributes(rpc: str, request, model_name: str) -> dict:
    """GenAI attributes of a GenerateRequest (what was asked)."""
    attributes = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": model_name,
                  "rpc.system": "grpc", "rpc.method": rpc, "gen_ai.request.stream": rpc == "GenerateStream"}
    if request is not None and hasattr(request, "HasField") and request.HasField("sampling"):
        s = request.sampling
        for field, key in (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
                           ("top_k", "gen_ai.request.top_k"), ("seed", "gen_ai.request.seed"),
                           ("max_new_tokens", "gen_ai.request.max_tokens")):
            if s.HasField(field):
                attributes[key] = getattr(s, field)
    if request is not None and getattr(request, "request_id", ""):
        attributes["gen_ai.request.id"] = request.request_id
    return attributes


def result_attributes(request_id: str, finish_reason: str, stats) -> dict:
    """GenAI + dspine attributes of a finished request (what happened)."""
    attributes = {"gen_ai.response.id": request_id, "gen_ai.response.finish_reasons": (finish_reason,)}
    if stats is None:
        return attributes
    attributes.update({"gen_ai.usage.input_tokens": stats.num_prompt_tokens,
                       "gen_ai.usage.output_tokens": stats.num_output_tokens,
                       "dspine.speculative": stats.speculative})
    if stats.time_to_first_token is not None:
        attributes["gen_ai.server.time_to_first_token"] = stats.time_to_first_token
    if stats.spec is not None:
        attributes.update({"dspine.spec.cycles": stats.spec.num_cycles,
                           "dspine.spec.mean_accepted_len": stats.spec.mean_accepted_len,
                           "dspine.spec.accepted_len_histogram": tuple(stats.spec.accepted_len_histogram),
                           "dspine.spec.draft_tokens": stats.spec.num_draft_tokens,
                           "dspine.spec.accepted_tokens": stats.spec.num_accepted_tokens,
                           "dspine.spec.drafter": stats.drafter})
    for stage in (*STAGES, "other"):
        attributes[f"dspine.stage.{stage}_s"] = getattr(stats.stage_times, stage)
    return attributes


def _span(span_tracer, name: str, parent_ctx, start: float, end: float, attributes: Mapping | None = None):
    span = span_tracer.start_span(name, context=parent_ctx, start_time=to_epoch_ns(start), attributes=attributes)
    return span, trace.set_span_in_context(span, parent_ctx), to_epoch_ns(max(end, start))


def record_engine_spans(stats, parent_ctx, attributes: Mapping | None = None, max_step_spans: int = 64,
                        tracer_provider=None) -> None:
    """The spans of one finished request from its ``RequestStats`` (see the module docstring), into
    the process's tracer provider, or into ``tracer_provider`` (a bench's own, which leaves the
    process-wide provider unset: OpenTelemetry lets a process set that only once)."""
    if stats is None or stats.finish_time is None or (tracer_provider is None and not enabled()):
        return
    span_tracer = tracer() if tracer_provider is None else tracer_provider.get_tracer(TRACER_NAME)
    try:
        _record(span_tracer, stats, parent_ctx, dict(attributes or {}), max_step_spans)
    except Exception:  # noqa: BLE001
        logger.exception("could not record the engine spans of a request")


def _record(span_tracer, stats, parent_ctx, attributes: dict, max_step_spans: int) -> None:
    root, root_ctx, root_end = _span(span_tracer, "dspine.engine", parent_ctx, stats.arrival_time, stats.finish_time,
                                     attributes)
    scheduled = stats.scheduled_time if stats.scheduled_time is not None else stats.arrival_time
    queue, _, queue_end = _span(span_tracer, "dspine.queue", root_ctx, stats.arrival_time, scheduled)
    queue.end(end_time=queue_end)
    steps = stats.steps
    prefill_steps = [s for s in steps if any(i.stage == "prefill" for i in s.intervals)]
    decode_start = scheduled
    if prefill_steps:
        first = prefill_steps[0]
        prefill, _, prefill_end = _span(span_tracer, "dspine.prefill", root_ctx, first.start, first.end,
                                        {"gen_ai.usage.input_tokens": stats.num_prompt_tokens})
        prefill.end(end_time=prefill_end)
        decode_start = first.end
        steps = [s for s in steps if s is not first]
    decode, decode_ctx, decode_end = _span(span_tracer, "dspine.decode", root_ctx, decode_start, stats.finish_time,
                                           {"dspine.steps": len(steps)})
    keep = steps
    if len(steps) > max_step_spans:
        half = max_step_spans // 2
        keep = steps[:half] + steps[-half:]
        decode.set_attribute("dspine.steps_omitted", len(steps) - len(keep))
    request_id = attributes.get("gen_ai.response.id")
    for step in keep:
        own = [i for i in step.intervals if request_id is None or request_id in i.request_ids]
        speculative = any(i.stage in _SPEC_STAGES for i in own)
        step_attributes = {"dspine.step": step.index, "dspine.batch_size": len(step.request_ids)}
        if speculative and request_id in step.accepted_len:
            step_attributes["dspine.accepted_len"] = step.accepted_len[request_id]
            step_attributes["dspine.verified_rows"] = step.num_verified.get(request_id, 0)
        span, span_ctx, span_end = _span(span_tracer, "dspine.cycle" if speculative else "dspine.target_step",
                                         decode_ctx, step.start, step.end, step_attributes)
        if speculative:
            for interval in own:
                child, _, child_end = _span(span_tracer, f"dspine.{interval.stage}", span_ctx, interval.start,
                                            interval.end)
                child.end(end_time=child_end)
        span.end(end_time=span_end)
    decode.end(end_time=decode_end)
    root.end(end_time=root_end)


class RequestSpan:
    """The live span of one RPC at the gRPC edge (standalone servicer or the Ray ingress)."""

    def __init__(self, rpc: str, request, model_name: str, parent_ctx=None):
        self.span = None
        if not enabled():
            return
        try:
            self.span = tracer().start_span(f"dspine.v1.DSpine/{rpc}", context=parent_ctx, kind=SpanKind.SERVER,
                                            attributes=request_attributes(rpc, request, model_name))
        except Exception:  # noqa: BLE001
            logger.exception("could not start a request span")

    @property
    def context(self):
        """The context whose parent is this span (or the current one when not tracing)."""
        return trace.set_span_in_context(self.span) if self.span is not None else otel_context.get_current()

    def activate(self):
        """Make this span current for a block (e.g. a handle call, so Serve's routing spans nest
        under it); a no-op when not tracing. Never spans a ``yield``."""
        if self.span is None:
            return contextlib.nullcontext()
        return trace.use_span(self.span, end_on_exit=False)

    def finish(self, code_name: str = "OK", error: str | None = None) -> None:
        if self.span is None:
            return
        try:
            self.span.set_attribute("rpc.grpc.status_code", code_name)
            if error is not None:
                self.span.set_status(Status(StatusCode.ERROR, f"{code_name}: {error}"[:500]))
            self.span.end()
        except Exception:  # noqa: BLE001
            logger.exception("could not end a request span")
        self.span = None
