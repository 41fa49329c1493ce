"""``dspine bench cluster``: the serving path against the engine, in one run, with same-run ratios.

Three things are measured, each against a baseline taken in the same run
(the machine is noisy, so the phases are interleaved round by round):

1. **Latency at concurrency 1**: one request of ``new_tokens`` tokens at a
   time, the same prompts, through (a) the engine stepping inline in this
   process, (b) the standalone gRPC server (a subprocess), (c) the Ray Serve
   cluster (proxy -> ingress -> replica). Median end-to-end latency and TTFT.
2. **Throughput under load**: ``num_requests`` streaming requests with
   ``concurrency`` in flight, through the cluster with 1 replica and with 2
   (one torch thread each), and the same workload straight into one engine
   (``generate_many``, inline). Tokens/s, TTFT and inter-token latency
   p50/p99, errors by status.

Every serving process uses ``threads`` torch threads (default 1), so a
2-replica cluster on a 2-core machine is 2 x 1 thread.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from .client import AsyncDSpineClient
from .client_errors import DSpineClientError


# ------------------------------------------------------------------ load generator
@dataclass
class LoadReport:
    """One workload's client-side figures."""

    name: str
    num_requests: int
    concurrency: int
    wall_s: float
    tokens: int
    latencies_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per request: seconds per token after the first
    errors: Counter = field(default_factory=Counter)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        return {"name": self.name, "requests": self.num_requests, "concurrency": self.concurrency,
                "tokens_per_s": round(self.tokens_per_s, 1), "latency_p50_s": _pct(self.latencies_s, 50),
                "ttft_p50_s": _pct(self.ttft_s, 50), "ttft_p99_s": _pct(self.ttft_s, 99),
                "itl_p50_ms": _ms(_pct(self.itl_s, 50)), "itl_p99_ms": _ms(_pct(self.itl_s, 99)),
                "errors": dict(self.errors)}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[index], 4)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


async def run_load(address: str, name: str, prompts: list[list[int]], concurrency: int, sampling: dict,
                   application: str | None = None, timeout_s: float = 300.0) -> LoadReport:
    """Stream every prompt through the gRPC server at ``address``, ``concurrency`` at a time."""
    report = LoadReport(name, len(prompts), concurrency, 0.0, 0)
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)

    async def worker(client: AsyncDSpineClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            start = time.perf_counter()
            first = None
            tokens = 0
            try:
                async for chunk in client.generate_stream(token_ids=prompt, **sampling):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter()
                    tokens += len(chunk.token_ids)
            except DSpineClientError as e:
                report.errors[e.code.name] += 1
                continue
            end = time.perf_counter()
            report.tokens += tokens
            report.latencies_s.append(end - start)
            if first is not None:
                report.ttft_s.append(first - start)
                if tokens > 1:
                    report.itl_s.append((end - first) / (tokens - 1))

    async with AsyncDSpineClient(address, application=application, timeout=timeout_s) as client:
        await client.wait_ready(30)
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        report.wall_s = time.perf_counter() - start
    return report


def run_inline(engine, name: str, prompts: list[list[int]], concurrency: int, params) -> LoadReport:
    """The same workload straight into one engine, stepping inline (no server, no network)."""
    report = LoadReport(name, len(prompts), concurrency, 0.0, 0)
    start = time.perf_counter()
    if concurrency == 1:
        for prompt in prompts:
            t0 = time.perf_counter()
            result = engine.generate(prompt, params)
            report.latencies_s.append(time.perf_counter() - t0)
            report.tokens += len(result.token_ids)
            if result.stats.time_to_first_token is not None:
                report.ttft_s.append(result.stats.time_to_first_token)
    else:
        for result in engine.generate_many(prompts, params):
            report.tokens += len(result.token_ids)
            if result.stats.time_to_first_token is not None:
                report.ttft_s.append(result.stats.time_to_first_token)
    report.wall_s = time.perf_counter() - start
    return report


# ------------------------------------------------------------------ servers under test
class StandaloneServer:
    """``dspine serve --standalone`` in a subprocess (its own process, as users run it)."""

    def __init__(self, threads: int, max_concurrency: int, target_dir=None, draft_dir=None):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        models = [*(["--target", str(target_dir)] if target_dir else []),
                  *(["--draft", str(draft_dir)] if draft_dir else [])]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dspine.cluster.cli", "serve", "--standalone", "--port", "0", "--device", "cpu",
             "--dtype", "float32", "--max-concurrency", str(max_concurrency), *models],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.proc.stdout.readline()
        if "serving on" not in line:
            self.proc.kill()
            raise RuntimeError(f"standalone server did not start: {line!r}")
        self.address = line.strip().rsplit(" ", 1)[-1]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class BenchCluster:
    """A local Ray instance with one dspine application per replica count."""

    def __init__(self, replica_counts: tuple[int, ...], threads: int, max_concurrency: int):
        import socket

        import ray
        from ray import serve

        from .app import build_app
        from .config import ClusterConfig

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        ray.init(num_cpus=max(8, 2 * sum(replica_counts) * threads), include_dashboard=False, namespace="serve",
                 log_to_driver=False, logging_level="ERROR")
        base = ClusterConfig(grpc_port=port)
        serve.start(grpc_options=base.grpc_options(), http_options={"host": "127.0.0.1", "port": 0},
                    logging_config={"log_level": "WARNING"})
        for count in replica_counts:
            config = ClusterConfig(app_name=f"r{count}", grpc_port=port,
                                   engine={"device": "cpu", "dtype": "float32", "max_concurrency": max_concurrency,
                                           "num_threads": threads},
                                   replicas={"num_replicas": count, "num_cpus": threads, "max_queued_requests": 64})
            serve.run(build_app(config), name=config.app_name, route_prefix="/" + config.app_name, blocking=False)
        direct = config.model_copy(update={"app_name": "direct"})
        options = direct.engine_deployment_options()
        options.update(num_replicas=1, name="DirectEngineReplica")
        options.pop("request_router_config")
        serve.run(serve.deployment(DirectEngineReplica, **options).bind(direct.model_dump(mode="json")),
                  name="direct", route_prefix="/direct", blocking=False)
        self.address = f"127.0.0.1:{port}"

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


class DirectEngineReplica:
    """Bench-only variant: Serve's proxy calls the engine replica directly (no ingress hop, so no
    admission, failover or status translation); measures what the ingress costs."""

    def __init__(self, config):
        from .replica_deployment import EngineReplica

        self.replica = EngineReplica(config)

    async def GenerateStream(self, request, grpc_context):
        from .errors import set_status
        from .ingress import StreamFailed

        try:
            async for message in self.replica.generate_stream(request):
                yield message
        except Exception as e:  # noqa: BLE001
            set_status(grpc_context, e)
            raise StreamFailed(str(e)) from None


def _latency_paths(standalone: "StandaloneServer", cluster: "BenchCluster") -> list[tuple[str, str | None]]:
    """(address, application) of each path of the latency phase; "inline" first."""
    return [("inline", None), (standalone.address, None), (cluster.address, "r1"), (cluster.address, "direct")]


_LATENCY_NAMES = ("inline", "standalone", "cluster", "cluster-direct")


def _paired_latency(engine, prompts, params, sampling, paths, rounds: int) -> dict:
    """Each prompt through every path back to back (order rotating), so each ratio compares
    requests a second apart; returns medians of latencies, TTFTs and of the per-prompt ratios."""
    latencies = {name: [] for name in _LATENCY_NAMES}
    ttfts = {name: [] for name in _LATENCY_NAMES}
    ratios = {name: [] for name in _LATENCY_NAMES[1:]}
    for round_index in range(rounds):
        for i, prompt in enumerate(prompts):
            order = list(range(len(paths)))
            shift = (i + round_index) % len(order)
            measured = {}
            for k in order[shift:] + order[:shift]:
                address, app = paths[k]
                name = _LATENCY_NAMES[k]
                if address == "inline":
                    report = run_inline(engine, name, [prompt], 1, params)
                else:
                    report = asyncio.run(run_load(address, name, [prompt], 1, sampling, app))
                if not report.latencies_s:
                    raise RuntimeError(f"{name}: request failed: {dict(report.errors)}")
                measured[name] = report.latencies_s[0]
                latencies[name].append(report.latencies_s[0])
                ttfts[name] += report.ttft_s
            for name in ratios:
                ratios[name].append(measured[name] / measured["inline"])
    out = {name: {"median_ms": round(1000 * statistics.median(latencies[name]), 1),
                  "ttft_p50_ms": round(1000 * _pct(ttfts[name], 50), 1)} for name in _LATENCY_NAMES}
    for name, values in ratios.items():
        ordered = sorted(values)
        out[name]["ratio_vs_inline"] = {"median": round(statistics.median(values), 3),
                                        "p25": round(ordered[len(ordered) // 4], 3),
                                        "p75": round(ordered[3 * len(ordered) // 4], 3), "pairs": len(values)}
    return out


# ------------------------------------------------------------------ the bench
def bench_cluster(num_prompts: int = 8, prompt_len: int = 64, new_tokens: int = 96, temperature: float = 0.0,
                  seed: int | None = 0, rounds: int = 3, concurrency: int = 16, num_requests: int = 48,
                  threads: int = 1, max_concurrency: int = 8) -> dict:
    """Run every phase; returns the figures (and ratios) as a dict."""
    import torch

    from dspine import embedded
    from dspine.replica import Engine, EngineConfig, SamplingParams
    from dspine.replica.bench import heldout_prompts

    torch.set_num_threads(threads)
    engine = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR,
                                    EngineConfig(device="cpu", dtype="float32", num_threads=threads,
                                                 max_concurrency=max_concurrency))
    prompts = heldout_prompts(engine, num_prompts, prompt_len)
    params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=new_tokens, ignore_eos=True)
    sampling = dict(temperature=temperature, seed=seed, max_new_tokens=new_tokens, ignore_eos=True)
    load_prompts = [prompts[i % len(prompts)] for i in range(num_requests)]

    standalone = StandaloneServer(threads, max_concurrency)
    cluster = BenchCluster((1, 2), threads, max_concurrency)
    try:
        # Warm-up of every path (first-call costs: imports, allocator, routing caches).
        run_inline(engine, "warm", prompts[:2], 1, params)
        for address, app in _latency_paths(standalone, cluster)[1:]:
            asyncio.run(run_load(address, "warm", prompts[:2], 1, sampling, app))
        latency = _paired_latency(engine, prompts, params, sampling, _latency_paths(standalone, cluster), rounds)
        throughput: dict[str, list[LoadReport]] = {"engine": [], "cluster-1": [], "cluster-2": []}
        for _ in range(rounds):
            throughput["engine"].append(run_inline(engine, "engine", load_prompts, concurrency, params))
            throughput["cluster-1"].append(asyncio.run(run_load(cluster.address, "cluster-1", load_prompts,
                                                                concurrency, sampling, "r1")))
            throughput["cluster-2"].append(asyncio.run(run_load(cluster.address, "cluster-2", load_prompts,
                                                                concurrency, sampling, "r2")))
    finally:
        standalone.close()
        cluster.close()

    def per_round_ratio(num: list[LoadReport], den: list[LoadReport], key) -> list[float]:
        return [round(key(a) / key(b), 3) for a, b in zip(num, den)]

    result = {
        "settings": dict(new_tokens=new_tokens, temperature=temperature, prompts=len(prompts), rounds=rounds,
                         concurrency=concurrency, requests=num_requests, threads=threads),
        "latency_c1": latency,
        "throughput": {name: [r.summary() for r in reports] for name, reports in throughput.items()},
    }
    tps = {name: statistics.median(r.tokens_per_s for r in reports) for name, reports in throughput.items()}
    result["throughput_tokens_per_s"] = {k: round(v, 1) for k, v in tps.items()}
    result["throughput_ratio_cluster1_vs_engine"] = round(tps["cluster-1"] / tps["engine"], 3)
    result["throughput_ratio_2_vs_1_replicas"] = round(tps["cluster-2"] / tps["cluster-1"], 3)
    result["throughput_ratio_2_vs_1_per_round"] = per_round_ratio(throughput["cluster-2"], throughput["cluster-1"],
                                                                  lambda r: r.tokens_per_s)
    return result


def format_report(result: dict) -> str:
    s = result["settings"]
    lat = result["latency_c1"]
    lines = [
        f"serving path vs engine: {s['new_tokens']} new tokens, temperature {s['temperature']}, "
        f"{s['threads']} torch thread(s) per engine, {s['rounds']} interleaved rounds",
        "latency at concurrency 1 (each prompt through every path back to back; median of per-prompt ratios):",
    ]
    for name, figures in lat.items():
        ratio = figures.get("ratio_vs_inline")
        text = (f"   {ratio['median']:.3f}x inline (p25 {ratio['p25']:.3f}, p75 {ratio['p75']:.3f}, "
                f"{ratio['pairs']} pairs)") if ratio else ""
        lines.append(f"  {name:<15} {figures['median_ms']:8.1f} ms   TTFT {figures['ttft_p50_ms']:6.1f} ms{text}")
    lines.append(f"throughput, {s['requests']} streaming requests, {s['concurrency']} in flight (median of rounds):")
    for name, reports in result["throughput"].items():
        last = reports[-1]
        # Inline generate_many has no per-chunk clock: no inter-token latency for the engine.
        itl = f"{last['itl_p50_ms']}/{last['itl_p99_ms']} ms" if name != "engine" else "-"
        lines.append(f"  {name:<10} {result['throughput_tokens_per_s'][name]:8.1f} tok/s   TTFT p50/p99 "
                     f"{last['ttft_p50_s'] * 1000:.0f}/{last['ttft_p99_s'] * 1000:.0f} ms   ITL p50/p99 "
                     f"{itl}   errors {last['errors'] or 'none'}")
    lines.append(f"  1-replica cluster / engine: {result['throughput_ratio_cluster1_vs_engine']:.3f}x")
    lines.append(f"  2 replicas / 1 replica:     {result['throughput_ratio_2_vs_1_replicas']:.3f}x  "
                 f"(per round {result['throughput_ratio_2_vs_1_per_round']})")
    return "\n".join(lines)


# ------------------------------------------------------------------ tracing overhead
def bench_tracing_overhead(engine, prompts: list[list[int]], params, repeats: int = 3) -> dict:
    """Decode time with tracing off vs on, paired prompt by prompt in one run.

    "On" is what a traced server adds per request: the engine spans built from the step
    records (cluster.tracing) into a batch span processor, and precise stage timing. The
    ratio is of end-to-end request time (generate + span recording)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from . import tracing

    if not tracing.enabled():
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
        from opentelemetry import trace

        trace.set_tracer_provider(provider)
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
                    tracing.record_engine_spans(result.stats, None, attributes)
                measured[traced] = time.perf_counter() - start
            engine.set_precise_timing(False)
            off_s.append(measured[False])
            on_s.append(measured[True])
            ratios.append(measured[True] / measured[False])
    return {"tracing_on_vs_off_median": round(statistics.median(ratios), 4),
            "off_median_s": round(statistics.median(off_s), 4), "on_median_s": round(statistics.median(on_s), 4),
            "pairs": len(ratios)}


# ------------------------------------------------------------------ the sweep, served
def bench_sweep_server(prompts: list[list[int]], repeats: int = 3, seed: int = 0, regimes=None, threads: int = 2,
                       target_dir=None, draft_dir=None) -> list[dict]:
    """``dspine bench engine --sweep`` through the standalone gRPC server (a subprocess, streamed
    through the SDK): per regime, target-only (``speculative=False``) and speculative requests of
    the same prompts, interleaved with alternating order, ``repeats`` paired runs; the ratio is the
    median of the paired ratios. Rows as :func:`dspine.replica.bench.bench_sweep`'s (the policy's
    counters live in the server, so acceptance and drafting share are not reported)."""
    from dspine.replica.bench import SWEEP_REGIMES

    regimes = SWEEP_REGIMES if regimes is None else regimes
    server = StandaloneServer(threads, 8, target_dir, draft_dir)
    rows = []
    try:
        asyncio.run(run_load(server.address, "warm", prompts[:1], 1,
                             dict(max_new_tokens=4, ignore_eos=True, speculative=True)))
        for name, overrides, max_new_tokens, concurrency in regimes:
            group = prompts if concurrency == 1 else (prompts * concurrency)[: max(len(prompts), concurrency)]
            sampling = dict(max_new_tokens=max_new_tokens, seed=seed, ignore_eos=True, **overrides)
            rates: dict[bool, list[float]] = {False: [], True: []}
            tokens: dict[bool, list[int]] = {False: [], True: []}
            for repeat in range(repeats):
                for speculative in ((False, True) if repeat % 2 == 0 else (True, False)):
                    report = asyncio.run(run_load(server.address, name, group, concurrency,
                                                  {**sampling, "speculative": speculative}))
                    if report.errors:
                        raise RuntimeError(f"{name}: requests failed through the server: {dict(report.errors)}")
                    rates[speculative].append(report.tokens_per_s)
                    tokens[speculative].append(report.tokens)
            ratios = [spec / base for spec, base in zip(rates[True], rates[False])]
            rows.append({"regime": name, "speedup": statistics.median(ratios), "run_speedups": ratios,
                         "target_only_tokens_per_s": statistics.median(rates[False]),
                         "speculative_tokens_per_s": statistics.median(rates[True]),
                         "mean_accepted_len": None, "mean_verified_len": None, "drafting_share": None,
                         "identical_greedy_output": None,
                         "tokens": {"target_only": tokens[False], "speculative": tokens[True]}})
    finally:
        server.close()
    return rows
