"""``dspine bench engine --tracing``: what request tracing costs, tracing off vs on in one run."""

from __future__ import annotations

import statistics
import time


def bench_tracing_overhead(engine, prompts: list[list[int]], params, repeats: int = 3) -> dict:
    """Decode time with tracing off vs on, paired prompt by prompt in one run.

    "On" is what a traced server adds per request: the engine spans built from the step
    records (cluster.tracing) into a batch span processor, and precise stage timing. The
    ratio is of end-to-end request time (generate + span recording)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from dspine.cluster import tracing

    # A provider of the bench's own (the process-wide one can be set only once, and a server or a
    # test in the same process may want it): what a traced server adds is the same.
    provider = None
    if not tracing.enabled():
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    ratios, off_s, on_s = [], [], []
    for repeat in range(repeats):
        for i, prompt in enumerate(prompts):
            measured = {}
            for traced in ((False, True) if (repeat + i) % 2 == 0 else (True, False)):
                engine.set_precise_timing(traced)
                start = time.perf_counter()
                result = engine.generate(prompt, params)
                if traced:
                    attributes = tracing.result_attributes(result.request_id, result.finish_reason, result.stats)
                    tracing.record_engine_spans(result.stats, None, attributes, tracer_provider=provider)
                measured[traced] = time.perf_counter() - start
            engine.set_precise_timing(False)
            off_s.append(measured[False])
            on_s.append(measured[True])
            ratios.append(measured[True] / measured[False])
    return {"tracing_on_vs_off_median": round(statistics.median(ratios), 4),
            "off_median_s": round(statistics.median(off_s), 4), "on_median_s": round(statistics.median(on_s), 4),
            "pairs": len(ratios)}

