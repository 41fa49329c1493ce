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
import statistics

from .load import LoadReport, percentile, run_inline, run_load
from .servers import BenchCluster, StandaloneServer


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
                  "ttft_p50_ms": round(1000 * percentile(ttfts[name], 50), 1)} for name in _LATENCY_NAMES}
    for name, values in ratios.items():
        ordered = sorted(values)
        out[name]["ratio_vs_inline"] = {"median": round(statistics.median(values), 3),
                                        "p25": round(ordered[len(ordered) // 4], 3),
                                        "p75": round(ordered[3 * len(ordered) // 4], 3), "pairs": len(values)}
    return out


def bench_cluster(num_prompts: int = 8, prompt_len: int = 64, new_tokens: int = 96, temperature: float = 0.0,
                  seed: int | None = 0, rounds: int = 3, concurrency: int = 16, num_requests: int = 48,
                  threads: int = 1, max_concurrency: int = 8) -> dict:
    """Run every phase; returns the figures (and ratios) as a dict."""
    import torch

    from dspine import embedded
    from dspine.replica import Engine, EngineConfig, SamplingParams

    from .prompts import heldout_prompts

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
    """``bench_cluster``'s figures as the table ``dspine bench cluster`` prints."""
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
