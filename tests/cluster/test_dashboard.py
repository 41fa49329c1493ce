"""The Grafana dashboard queries only metrics the servers export (names as Prometheus sees them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from dspine.cluster.metrics import ServingMetrics
from dspine.replica.types import RequestStats, SpecDecodingStats

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster" / "dashboards" / "dspine.json"
_UNIT_SUFFIX = {"s": "_seconds"}


def _prometheus_series() -> set[str]:
    """Every series name the instruments produce once exported to Prometheus."""
    reader = InMemoryMetricReader()
    stats = RequestStats(num_prompt_tokens=3, num_output_tokens=5, speculative=True, spec=SpecDecodingStats(15),
                         arrival_time=0.0, first_token_time=0.1, finish_time=0.5)
    stats.spec.observe_draft(15, 2)
    stats.stage_times.verify = 0.2
    metrics = ServingMetrics(load=lambda: type("L", (), {"in_flight": 1, "draft_slots": 9, "free_draft_slots": 4})(),
                             meter_provider=MeterProvider(metric_readers=[reader]))
    metrics.record_status("OK", 0.5)
    metrics.record_engine(stats)
    names = set()
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                base = metric.name.replace(".", "_") + _UNIT_SUFFIX.get(metric.unit, "")
                kind = type(metric.data).__name__
                if kind == "Histogram":
                    names |= {base + "_bucket", base + "_sum", base + "_count"}
                elif kind == "Sum":
                    names.add(base + "_total")
                else:
                    names.add(base)
    return names


def test_dashboard_is_valid_and_every_query_names_an_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exported = _prometheus_series()
    queried = set()
    for panel in panels:
        for target in panel["targets"]:
            if target["datasource"]["type"] == "prometheus":
                # Series names only: drop label selectors {...} and grouping clauses by (...).
                expr = re.sub(r"by \([^)]*\)", "", re.sub(r"\{[^}]*\}", "", target["expr"]))
                queried |= set(re.findall(r"\b((?:dspine|gen_ai)_[a-z_]+)", expr))
            else:
                assert 'name = "dspine.engine"' in target["query"]  # the engine span of record_engine_spans
    assert queried and queried <= exported, queried - exported
    # Every instrument has a panel.
    families = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in exported}
    assert families <= {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in queried}, families
