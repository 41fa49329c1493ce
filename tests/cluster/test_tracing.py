"""Traces and metrics of the standalone server: one trace per request, client -> server -> engine stages."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from dspine.cluster.client import DSpineClient
from dspine.cluster.metrics import ServingMetrics

from .conftest import idle, make_engine, wait_until

STAGE_CHILDREN = {"dspine.queue", "dspine.prefill", "dspine.decode"}


def complete(root_span_id: str, rpc_spans: int = 2):
    """Predicate: the trace holds the engine spans, ``rpc_spans`` RPC spans and every parent."""
    def check(spans) -> bool:
        ids = {s.span_id for s in spans} | {root_span_id}
        names = [s.name for s in spans]
        return ("dspine.engine" in names and "dspine.decode" in names
                and sum(n.startswith("dspine.v1.DSpine/") for n in names) >= rpc_spans
                and all(s.parent_id in ids for s in spans if s.span_id != root_span_id))
    return check


def check_request_trace(spans, rpc: str, root_span_id: str, output_tokens: int) -> dict:
    """The parent links of one request's trace; returns spans by name (one each above the cycles)."""
    spans = [s for s in spans if s.span_id != root_span_id]
    by_id = {s.span_id: s for s in spans}
    for span in spans:
        assert span.parent_id == root_span_id or span.parent_id in by_id, f"{span.name}: parent not in the trace"
    client = [s for s in spans if s.name == f"dspine.v1.DSpine/{rpc}" and s.parent_id == root_span_id]
    assert len(client) == 1, [(s.name, s.parent_id) for s in spans]
    engine = [s for s in spans if s.name == "dspine.engine"]
    assert len(engine) == 1
    engine = engine[0]
    chain = []
    node = engine
    while node.parent_id in by_id:
        node = by_id[node.parent_id]
        chain.append(node.name)
    assert chain[-1] == f"dspine.v1.DSpine/{rpc}" and node.span_id == client[0].span_id, chain
    stages = [s for s in spans if s.parent_id == engine.span_id]
    assert {s.name for s in stages} == STAGE_CHILDREN
    server_side = by_id[engine.parent_id]
    covered = sum(s.duration_s for s in stages)
    assert covered >= 0.9 * server_side.duration_s, (covered, server_side.duration_s, server_side.name)
    decode = next(s for s in stages if s.name == "dspine.decode")
    cycles = [s for s in spans if s.parent_id == decode.span_id]
    assert cycles and {s.name for s in cycles} <= {"dspine.cycle", "dspine.target_step"}
    cycle = next((s for s in cycles if s.name == "dspine.cycle"), None)
    if cycle is not None:
        assert {s.name for s in spans if s.parent_id == cycle.span_id} == {
            "dspine.draft", "dspine.tail", "dspine.verify", "dspine.commit"}
        assert 0 <= cycle.attributes["dspine.accepted_len"] <= 15
    assert engine.attributes["gen_ai.usage.output_tokens"] == output_tokens
    assert engine.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert "gen_ai.request.model" in engine.attributes and "dspine.spec.cycles" in engine.attributes
    assert engine.attributes["dspine.spec.drafter"] == "greedy"
    return {"engine": engine, "server": server_side, "client": client[0]}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_one_trace_per_request_from_client_to_engine_stages(serve, tokenizer, otlp, stream):
    server = serve(make_engine(tokenizer))
    tracer = trace.get_tracer("test")
    with DSpineClient(server.address, timeout=60) as client, tracer.start_as_current_span("test-root") as root:
        if stream:
            tokens = [t for chunk in client.generate_stream(token_ids=[1, 2, 3], max_new_tokens=20, ignore_eos=True)
                      for t in chunk.token_ids]
        else:
            tokens = client.generate(token_ids=[1, 2, 3], max_new_tokens=20, ignore_eos=True).token_ids
        trace_id = format(root.get_span_context().trace_id, "032x")
        root_id = format(root.get_span_context().span_id, "016x")
    spans = otlp.wait_for_trace(trace_id, complete(root_id))
    rpc = "GenerateStream" if stream else "Generate"
    check_request_trace(spans, rpc, root_id, len(tokens))
    servers = [s for s in spans if s.name == f"dspine.v1.DSpine/{rpc}" and s.parent_id != root_id]
    assert len(servers) == 1 and servers[0].attributes["rpc.grpc.status_code"] == "OK"


def test_streaming_cancel_frees_the_slot_with_tracing_on(serve, tokenizer, otlp):
    server = serve(make_engine(tokenizer))
    with DSpineClient(server.address, timeout=60) as client:
        stream = client.generate_stream(token_ids=[1, 2, 3], max_new_tokens=80, ignore_eos=True)
        assert next(stream).token_ids
        stream.cancel()
    wait_until(lambda: idle(server.engine), timeout=10, what="the cancelled stream's slot")


def test_metrics_after_a_known_load_are_exact(serve, tokenizer):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    engine = make_engine(tokenizer)
    metrics = ServingMetrics(load=engine.load, meter_provider=MeterProvider(metric_readers=[reader]))
    server = serve(engine, metrics=metrics)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with DSpineClient(server.address, timeout=60) as client:
        outputs = [len(client.generate(token_ids=p, max_new_tokens=10 + i, ignore_eos=True).token_ids)
                   for i, p in enumerate(prompts)]
        with pytest.raises(Exception):
            client.generate(token_ids=[1, 2], temperature=-1.0)

    def collect():
        points = {}
        for resource in reader.get_metrics_data().resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        points[(metric.name, tuple(sorted(point.attributes.items())))] = point
        return points

    # The server records an RPC's status after the reply has gone out: wait for the fourth.
    points = wait_until(lambda: (p := collect()) and sum(
        v.value for k, v in p.items() if k[0] == "dspine.requests") == 4 and p, timeout=10, what="4 requests")
    assert points[("dspine.requests", (("rpc.grpc.status_code", "OK"),))].value == 3, sorted(points)
    assert points[("dspine.requests", (("rpc.grpc.status_code", "INVALID_ARGUMENT"),))].value == 1, sorted(points)
    assert points[("dspine.tokens", (("gen_ai.token.type", "output"),))].value == sum(outputs) == 10 + 11 + 12
    assert points[("dspine.tokens", (("gen_ai.token.type", "input"),))].value == sum(map(len, prompts))
    assert points[("gen_ai.server.time_to_first_token", ())].count == 3
    assert points[("dspine.requests.in_flight", ())].value == 0
    cycles = points[("dspine.spec.accepted_len", ())]
    assert cycles.count > 0 and cycles.sum <= cycles.count * 15


def test_generate_trace_prints_the_trace_id_of_the_whole_call(serve, tokenizer, otlp, capsys):
    from dspine.cluster.cli import main

    server = serve(make_engine(tokenizer))
    assert main(["generate", "--server", server.address, "--prompt", "def f():", "--max-new-tokens", "6",
                 "--trace"]) == 0
    line = [entry for entry in capsys.readouterr().err.splitlines() if entry.startswith("trace id: ")]
    assert len(line) == 1
    trace_id = line[0].split()[-1]
    spans = otlp.wait_for_trace(trace_id, lambda s: {"dspine generate", "dspine.engine"} <= {x.name for x in s})
    assert sum(s.name == "dspine.v1.DSpine/Generate" for s in spans) == 2  # the SDK's and the server's
