"""OpenTelemetry metrics of a server: requests by status, tokens, stage latencies, acceptance, load.

Export is OTLP push (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``..._METRICS_ENDPOINT``,
every ``OTEL_METRIC_EXPORT_INTERVAL`` ms) to the same collector that receives
the traces; Prometheus scrapes the collector. Why not a Prometheus port per
process: Ray places several replica processes on one node (and pod), each
would need its own port and scrape target, and replicas come and go; one
push per process to the node's collector has neither problem. (Ray's own
per-node metrics export is the other option; it would tie the metrics to Ray
and leave the standalone server without them.)

The collector's Prometheus exporter should run with
``resource_to_telemetry_conversion: enabled`` so that ``service.name`` and
``dspine.replica_id`` become labels (the dashboard, cluster/dashboards/dspine.json,
filters and groups by them).

Instruments (names as the OpenTelemetry GenAI conventions define them where
they exist; Prometheus turns dots into underscores and appends the unit):

=====================================  =========  =========================================
gen_ai.server.request.duration         histogram  s, by rpc.grpc.status_code
gen_ai.server.time_to_first_token      histogram  s
gen_ai.server.time_per_output_token    histogram  s (a request's decode time / tokens after the first)
dspine.stage.duration                  histogram  s, by dspine.stage (a request's own stage time)
dspine.spec.accepted_len               histogram  draft tokens accepted per cycle
dspine.requests                        counter    by rpc.grpc.status_code
dspine.tokens                          counter    by gen_ai.token.type (input / output)
dspine.requests.in_flight              gauge      per replica
dspine.draft_pool.used                 gauge      draft KV slots in use, per replica
=====================================  =========  =========================================
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from opentelemetry import metrics
from opentelemetry.metrics import Observation

from dspine.replica.step_stats import STAGES

logger = logging.getLogger(__name__)

_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def configure_metrics(service_name: str, readers: list | None = None, replica_id: str | None = None) -> bool:
    """Install a meter provider for this process unless one exists; True when metrics are exported.
    ``readers`` (e.g. an ``InMemoryMetricReader`` in tests) replace the environment's OTLP export."""
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource

        if isinstance(metrics.get_meter_provider(), MeterProvider):
            return True
        if readers is None:
            env = os.environ
            if not (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")):
                return False
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers = [PeriodicExportingMetricReader(OTLPMetricExporter())]
        views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(_TIME_BUCKETS))
                 for name in ("gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
                              "gen_ai.server.time_per_output_token", "dspine.stage.duration")]
        attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}
        if replica_id:
            attributes["dspine.replica_id"] = replica_id  # the dashboard's per-replica panels
        provider = MeterProvider(metric_readers=readers, views=views, resource=Resource.create(attributes))
        metrics.set_meter_provider(provider)
        return True
    except Exception:  # noqa: BLE001
        logger.exception("metrics setup failed; continuing without metrics")
        return False


class ServingMetrics:
    """The instruments; ``load`` (an ``Engine.load``) feeds the gauges of an engine's process."""

    def __init__(self, load: Callable | None = None, meter_provider=None):
        meter = (meter_provider or metrics.get_meter_provider()).get_meter("dspine")
        self.duration = meter.create_histogram("gen_ai.server.request.duration", unit="s",
                                               description="request duration on the server")
        self.ttft = meter.create_histogram("gen_ai.server.time_to_first_token", unit="s")
        self.tpot = meter.create_histogram("gen_ai.server.time_per_output_token", unit="s")
        self.stage = meter.create_histogram("dspine.stage.duration", unit="s",
                                            description="a request's own time in each engine stage")
        self.accepted = meter.create_histogram("dspine.spec.accepted_len", unit="{token}",
                                               description="draft tokens accepted per speculative cycle")
        self.requests = meter.create_counter("dspine.requests", unit="{request}",
                                             description="finished requests by gRPC status")
        self.tokens = meter.create_counter("dspine.tokens", unit="{token}", description="prompt and output tokens")
        if load is not None:
            def in_flight(_options):
                yield Observation(load().in_flight)

            def draft_used(_options):
                report = load()
                yield Observation(report.draft_slots - report.free_draft_slots)

            meter.create_observable_gauge("dspine.requests.in_flight", [in_flight], unit="{request}")
            meter.create_observable_gauge("dspine.draft_pool.used", [draft_used], unit="{slot}")

    def record_status(self, code_name: str, duration_s: float | None = None) -> None:
        """One finished RPC at the edge, whatever its outcome."""
        attributes = {"rpc.grpc.status_code": code_name}
        self.requests.add(1, attributes)
        if duration_s is not None:
            self.duration.record(duration_s, attributes)

    def record_engine(self, stats) -> None:
        """A finished request's engine-side figures (tokens, stage times, TTFT, acceptance)."""
        if stats is None:
            return
        try:
            self.tokens.add(stats.num_prompt_tokens, {"gen_ai.token.type": "input"})
            self.tokens.add(stats.num_output_tokens, {"gen_ai.token.type": "output"})
            for stage in (*STAGES, "other"):
                value = getattr(stats.stage_times, stage)
                if value:
                    self.stage.record(value, {"dspine.stage": stage})
            if stats.time_to_first_token is not None:
                self.ttft.record(stats.time_to_first_token)
            if stats.first_token_time is not None and stats.finish_time is not None and stats.num_output_tokens > 1:
                self.tpot.record((stats.finish_time - stats.first_token_time) / (stats.num_output_tokens - 1))
            if stats.spec is not None:
                for accepted, count in enumerate(stats.spec.accepted_len_histogram):
                    for _ in range(count):
                        self.accepted.record(accepted)
        except Exception:  # noqa: BLE001
            logger.exception("could not record a request's metrics")
