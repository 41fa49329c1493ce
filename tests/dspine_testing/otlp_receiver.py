"""A small OTLP/gRPC receiver on a real socket (no collector binary is installable here).

It implements the trace and metrics collector services, keeps every span it
receives (with its resource's ``service.name``) and every metric data point.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver):
        self.receiver = receiver

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next((_value(a.value) for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.receiver.add_span(ReceivedSpan(
                        service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        span.start_time_unix_nano, span.end_time_unix_nano,
                        {a.key: _value(a.value) for a in span.attributes}, span.status.code))
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver):
        self.receiver = receiver

    def Export(self, request, context):
        with self.receiver.lock:
            self.receiver.metric_requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpReceiver:
    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.metric_requests: list = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def add_span(self, span: ReceivedSpan) -> None:
        with self.lock:
            self.spans.append(span)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for_trace(self, trace_id: str, predicate, timeout: float = 30.0) -> list[ReceivedSpan]:
        end = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            if predicate(spans):
                return spans
            if time.monotonic() > end:
                names = sorted({f"{s.service}:{s.name}" for s in spans})
                raise AssertionError(f"trace {trace_id} incomplete after {timeout}s: {names}")
            time.sleep(0.1)

    def close(self) -> None:
        self.server.stop(0)
